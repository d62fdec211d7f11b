"""``python -m tasks.generate.worker``: one shard of a triggered batch, in the process an Airflow task starts.

The task (:mod:`tasks.orchestration.generate_process`) starts this module with the shard and the
storage root on its command line and the storage options and secrets on its stdin
(``--secrets-on-stdin``), so that neither is in its initial environment, and the process makes
itself non-dumpable (:func:`~tasks.process_memory.make_undumpable`). The batch config it reads from
storage is checked against the trigger policy again (:class:`HandOver`). It runs
:func:`tasks.generate.generate_shards` as ``rollout-ledger generate`` does, but only for what a
trigger may name (:meth:`Runnables.triggered`: a built-in game or an entry of the deployment's
registry, docs/security.md), writes log lines (never a progress bar) and the run's lines on
stderr, prints the shard's JSON summary on stdout (:func:`tasks.generate.console.summaries_json`)
and exits with the shared codes (:mod:`tasks.entry_point`): its parent tells a retryable failure
from a permanent one by the code alone. It stops (SIGTERM) when the task process dies.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.entry_point import configure_logging, run_command
from tasks.environments.registry import Runnables
from tasks.errors import EXIT_OK, ConfigError
from tasks.generate.console import check_rollouts, engine_notice, shard_lines, summaries_json
from tasks.generate.stage import generate_shards
from tasks.process_memory import make_undumpable
from tasks.storage.options import storage_options_from_env
from tasks.trigger_policy import TriggerPolicy

_PR_SET_PDEATHSIG = 1
HAND_OVER_KEYS = ("storage_options", "environment", "trigger_policy")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tasks.generate.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="storage root URL (its options: $ROLLOUT_LEDGER_STORAGE_OPTIONS)")
    parser.add_argument("--batch-id", required=True, help="the planned batch")
    parser.add_argument("--shard", type=int, required=True, help="the shard to generate")
    parser.add_argument("--try-number", type=int, default=None, help="the task's try, recorded in the attempt claim")
    parser.add_argument(
        "--secrets-on-stdin",
        action="store_true",
        help='read {"storage_options": {...}, "environment": {...}} on stdin (how the task hands over secrets)',
    )
    return parser.parse_args(argv)


@dataclass(frozen=True)
class HandOver:
    """What the task writes on the worker's stdin: storage options, secret variables, and the trigger policy's
    lists for this run (its servers connection's URLs, the models the policy lists)."""

    storage_options: dict[str, Any]
    environment: dict[str, str]
    servers: tuple[str, ...]
    models: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> HandOver:
        """The hand-over in ``text``; a ConfigError when it is not one."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"generate worker: stdin is not the task's JSON hand-over: {error.msg}") from None
        options, environment, policy = (value.get(key) if isinstance(value, dict) else None for key in HAND_OVER_KEYS)
        if not isinstance(options, dict) or not isinstance(environment, dict) or not isinstance(policy, dict):
            raise ConfigError(f"generate worker: stdin must be a JSON object with {list(HAND_OVER_KEYS)}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in environment.items()):
            raise ConfigError("generate worker: the handed-over environment must map names to strings")
        lists = [policy.get(key) for key in ("servers", "models")]
        if not all(isinstance(x, list) and all(isinstance(i, str) for i in x) for x in lists):
            raise ConfigError("generate worker: the handed-over trigger policy lists servers and models (strings)")
        return cls(options, environment, *(tuple(x) for x in lists))

    def check(self, config: BatchConfig) -> None:
        """The trigger policy again, on the batch config read from storage (:meth:`TriggerPolicy.check_config`)."""
        policy = TriggerPolicy("the generate task's hand-over", storage_urls=(), models=self.models)
        policy.check_config(config, server_urls=self.servers)


def run_shard(args: argparse.Namespace) -> int:
    """Generate ``args.shard``, say what it did on stderr and print its summary on stdout; 0 when committed, 2 when
    committed with every rollout failed (:class:`~tasks.generate.summary.RolloutsFailedError`).

    The batch config on storage is not trusted: the trigger policy is applied to it again before anything
    runs (its engine options, model and servers)."""
    if args.secrets_on_stdin:
        hand_over = HandOver.parse(sys.stdin.read())
        os.environ.update(hand_over.environment)  # this process's own: not its initial environment, which /proc shows
        batch = Batch.open(args.root, args.batch_id, hand_over.storage_options)
        hand_over.check(batch.config)
    else:
        batch = Batch.open(args.root, args.batch_id, storage_options_from_env(args.root, os.environ))
    summaries = generate_shards(
        batch,
        [args.shard],
        progress=False,
        try_number=args.try_number,
        on_engine_start=engine_notice(args.batch_id, verbose=False, say=_say),
        runnables=Runnables.triggered(),
    )
    for summary in summaries:
        for line in shard_lines(summary):
            _say(line)
    print(summaries_json(summaries), flush=True)
    check_rollouts(summaries)  # every rollout failed: exit 2, and the task fails at once with its line
    return EXIT_OK


def stop_with_parent() -> None:
    """SIGTERM this process when its parent (the task process) dies; exit now if it already has."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:
        raise SystemExit("generate: the task process that started this one is gone")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    make_undumpable()
    configure_logging(verbose=False)
    return run_command("generate", args.root, lambda: run_shard(args), verbose=False)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    stop_with_parent()
    raise SystemExit(main())
