"""A batch as a whole: ``status`` (what it holds), ``sweep`` (a committed shard's orphans), ``demo`` (a small batch)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from tasks.cli.context import lineage_sink, open_batch, say_lineage
from tasks.cli.flags import AddCommand, root_and_batch, shard_number
from tasks.errors import EXIT_OK

if TYPE_CHECKING:
    from tasks.lineage.emit import LineageSink


def add_status(add: AddCommand) -> None:
    parser = add("status", "what a batch holds: plan, shards and attempts, counts, dataset, reports")
    root_and_batch(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(run=run_status)


def add_sweep(add: AddCommand) -> None:
    parser = add("sweep", "delete objects of a committed shard that its marker does not name")
    root_and_batch(parser)
    parser.add_argument("--shard", type=shard_number, required=True, help="the committed shard to sweep")
    parser.add_argument("--dry-run", action="store_true", help="list the orphans, delete nothing")
    parser.set_defaults(run=run_sweep)


def add_demo(add: AddCommand) -> None:
    parser = add("demo", "plan, generate and finalize a small batch on the embedded defaults")
    parser.add_argument("--root", default=".demo/runs", help="storage root URL")
    parser.add_argument("--batch-id", default=None, help="batch id (default: demo-<timestamp>)")
    parser.set_defaults(run=run_demo)


def run_status(args: argparse.Namespace) -> int:
    from tasks.status.gather import batch_status
    from tasks.status.render import render_status

    status = batch_status(open_batch(args))
    print(json.dumps(status.to_dict(), indent=2, sort_keys=True) if args.json else render_status(status).rstrip())
    return EXIT_OK


def run_sweep(args: argparse.Namespace) -> int:
    from tasks.lineage.datasets import sweep_lineage
    from tasks.lineage.emit import NO_LINEAGE
    from tasks.storage.sweep import sweep_orphans

    batch = open_batch(args)
    lineage: LineageSink = NO_LINEAGE if args.dry_run else lineage_sink()
    with lineage.task("sweep_orphans", batch) as run:
        report = sweep_orphans(batch.store, args.shard, dry_run=args.dry_run)
        run.report(lambda: sweep_lineage(batch, shards=[args.shard]))
    say_lineage(lineage)
    verb = "would delete" if args.dry_run else "deleted"
    for path in report.orphans:
        print(f"{verb} {path}")
    print(f"{verb} {len(report.orphans)} orphan object(s); kept {len(report.kept)}")
    return EXIT_OK


def run_demo(args: argparse.Namespace) -> int:
    from tasks.demo import run_demo as demo
    from tasks.storage.root_urls import check_root_url

    demo(check_root_url(args.root), batch_id=args.batch_id)
    return EXIT_OK
