"""``rollout-ledger generate``: shards' rollouts on one engine, shown through :mod:`tasks.generate.console`.

The Airflow generate task runs the same library run through :mod:`tasks.generate.worker`. A shard whose
every rollout failed ends the command with exit 2 after its lines and JSON
(:func:`~tasks.generate.console.check_rollouts`).
"""

from __future__ import annotations

import argparse

from tasks.cli.context import lineage_sink, open_batch, say, say_lineage
from tasks.cli.flags import AddCommand, root_and_batch, shard_number
from tasks.environments.registry import Runnables
from tasks.errors import EXIT_OK, ConfigError
from tasks.process_memory import make_undumpable


def add_generate(add: AddCommand) -> None:
    parser = add("generate", "run shards' rollouts on one engine and commit each shard")
    root_and_batch(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--shard", type=shard_number, action="append", help="shard to generate; repeat to run several on one engine"
    )
    which.add_argument("--all-shards", action="store_true", help="every shard of the batch, on one engine")
    parser.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    parser.add_argument(
        "--try-number", type=int, default=None, help="the orchestrator's try number, recorded in the attempt claim"
    )
    parser.add_argument("--model", default=None, help="refused: the model is fixed at plan time (see plan --model)")
    parser.add_argument(
        "--declared-only",
        action="store_true",
        help="run only a built-in game or an entry of the environment registry (what a triggered batch's "
        "workers run: docs/security.md)",
    )
    parser.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from tasks.generate import generate_shards
    from tasks.generate.console import check_rollouts, engine_notice, shard_lines, summaries_json
    from tasks.lineage.datasets import TaskLineage, generate_lineage

    if args.model is not None:
        raise ConfigError(
            "generate takes no --model: the model is fixed at plan time (plan/batch.json records it and its hashes); "
            "plan a new batch id with --model to use another one"
        )
    make_undumpable()  # it holds the storage credentials and runs agents: no same-user process reads its memory
    batch = open_batch(args)
    shards = list(range(batch.config.shards)) if args.all_shards else args.shard
    lineage = lineage_sink()
    with lineage.task("generate", batch) as run:
        summaries = generate_shards(
            batch,
            shards,
            progress=False if args.no_progress else None,
            try_number=args.try_number,
            on_engine_start=engine_notice(args.batch_id, verbose=args.verbose, say=say),
            runnables=Runnables.triggered() if args.declared_only else Runnables.operator(),
        )
        run.report(lambda: TaskLineage.merged(generate_lineage(batch, shard) for shard in shards))
    for summary in summaries:
        for line in shard_lines(summary):
            say(line)
    say_lineage(lineage)
    print(summaries_json(summaries), flush=True)
    check_rollouts(summaries)
    return EXIT_OK
