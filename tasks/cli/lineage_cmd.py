"""``rollout-ledger lineage CHECKPOINT``: walk a checkpoint back to checkpoint 0, every hop checked by hash.

The walk is :func:`tasks.lineage.checkpoints.walk_checkpoint` (docs/lineage.md, "Checkpoints"): checkpoint →
the datasets it consumed → their batches → the checkpoint that sampled each → its parent … The tree goes to
stdout (``--json``: the same tree as JSON); a hop that does not verify is shown with its failed checks, and the
exit code is then 3, as for any integrity failure.
"""

from __future__ import annotations

import argparse
import json
import os

from tasks.cli.flags import AddCommand
from tasks.errors import EXIT_CONFLICT, EXIT_OK


def add_lineage(add: AddCommand) -> None:
    parser = add(
        "lineage",
        "walk a checkpoint back to checkpoint 0: the datasets it trained on, their batches, the checkpoint that "
        "sampled each, its parent ...; every hop checked by hash (exit 3 when one does not verify)",
    )
    parser.add_argument("checkpoint", help="a checkpoint folder (holding checkpoint.json)")
    parser.add_argument(
        "--checkpoints",
        action="append",
        default=[],
        metavar="DIR",
        help="a checkpoints root (step-NNNNNN folders) to look in for the checkpoint that sampled a batch; "
        "repeatable (the given checkpoint's own root is always searched)",
    )
    parser.add_argument("--json", action="store_true", help="print the tree as JSON")
    parser.set_defaults(run=run_lineage)


def run_lineage(args: argparse.Namespace) -> int:
    from tasks.lineage.checkpoints import render_tree, walk_checkpoint
    from tasks.storage.options import storage_options_from_env

    tree = walk_checkpoint(
        args.checkpoint,
        checkpoint_roots=args.checkpoints,
        storage_options=lambda url: storage_options_from_env(url, os.environ),
    )
    if args.json:
        failed = [f"{hop.kind} {hop.name}" for hop in tree.failed()]
        print(json.dumps({"ok": tree.all_ok, "failed": failed, "tree": tree.to_dict()}, indent=2))
    else:
        print(render_tree(tree), end="")
    return EXIT_OK if tree.all_ok else EXIT_CONFLICT
