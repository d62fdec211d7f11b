"""A generate run as its front-ends show it: the engine's start notice, a line per shard, the JSON summaries.

The ``rollout-ledger generate`` command and the generate worker (:mod:`tasks.generate.worker`)
both show a run through these functions, so a person at a terminal and an Airflow task log read
the same lines, and the worker's parent reads the same JSON (one object per shard) as a script
reading the CLI's stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from tasks.engines.startup import engine_log_path, engine_output_to
from tasks.generate.summary import ShardSummary

Say = Callable[[str], None]


def engine_notice(
    batch_id: str, *, verbose: bool, say: Say
) -> Callable[[float], contextlib.AbstractContextManager[None]]:
    """``generate_shards``'s ``on_engine_start``: say how long the engine takes to start and, unless
    ``verbose``, send the engine's own output to a log file under the batch's name (and say where)."""

    @contextlib.contextmanager
    def notice(expected_seconds: float) -> Iterator[None]:
        say(f"starting the engine (about {expected_seconds:.0f} s)")
        if verbose:
            yield
            return
        path = engine_log_path(batch_id, time.strftime("generate-%Y%m%d-%H%M%S") + f"-{os.getpid()}")
        say(f"engine log: {path} (-v shows it here)")
        with engine_output_to(path):
            yield

    return notice


def shard_lines(summary: ShardSummary) -> list[str]:
    """What a run did to one shard, for a person: the commit, the training signal, servers and failovers."""
    done = (
        f"already committed by attempt {summary.attempt}"
        if summary.already_committed
        else f"committed attempt {summary.attempt}: {summary.ok} ok, {summary.poisoned} poisoned, "
        f"{summary.failed} failed, {summary.adopted} adopted, {summary.generated_tokens} tokens "
        f"in {summary.seconds:.0f} s"
    )
    lines = [f"shard {summary.shard}: {done}"]
    lines += [f"  {line}" for line in (summary.signal.describe() if summary.signal is not None else ())]
    if summary.calls_by_replica:
        lines.append("  calls per server: " + ", ".join(f"{url} {n}" for url, n in summary.calls_by_replica.items()))
    lines += [f"  failed over: {failover}" for failover in summary.failovers]
    if summary.resumed:
        lines.append(
            f"  resumed {summary.resumed} rollout(s): {summary.replayed_calls} call(s) replayed, "
            f"{summary.live_calls} sampled live after, {summary.divergences} divergence(s)"
        )
    return lines


def summaries_json(summaries: Sequence[ShardSummary]) -> str:
    """The run's stdout: a JSON list with one object per shard (the training signal as ``training_signal``)."""
    return json.dumps([_summary_object(s) for s in summaries], indent=2)


def _summary_object(summary: ShardSummary) -> dict[str, Any]:
    data = asdict(summary)
    data.pop("signal")
    if summary.signal is not None:
        data["training_signal"] = asdict(summary.signal)
    return data
