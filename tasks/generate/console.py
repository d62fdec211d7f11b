"""A generate run as its front-ends show it: the engine's start notice, a line per shard, the JSON summaries.

The ``rollout-ledger generate`` command and the generate worker (:mod:`tasks.generate.worker`)
both show a run through these functions, so a person at a terminal and an Airflow task log read
the same lines, and the worker's parent reads the same JSON (one object per shard) as a script
reading the CLI's stdout. Both end with :func:`check_rollouts`: a shard whose every rollout failed
ends the run with :class:`~tasks.generate.summary.RolloutsFailedError` (exit 2) after its lines and JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from tasks.engines.startup import engine_log_path, engine_output_to
from tasks.generate.summary import RolloutsFailedError, ShardSummary

Say = Callable[[str], None]
ERROR_LINES_SHOWN = 6  # first lines of a recorded error (an agent's stderr) shown per failure reason
ERROR_LINE_CHARS = 240
ONE_LINE_CHARS = 300  # of the recorded error quoted in RolloutsFailedError's message


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
        f"already committed by attempt {summary.attempt}: {calls_text(summary)}"
        if summary.already_committed
        else f"committed attempt {summary.attempt}: {summary.ok} ok, {summary.poisoned} poisoned, "
        f"{summary.failed} failed, {summary.adopted} adopted, {calls_text(summary)}, "
        f"{summary.generated_tokens} tokens in {summary.seconds:.0f} s"
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
    return lines + failed_lines(summary)


def calls_text(summary: ShardSummary) -> str:
    """The calls the shard's rollouts use, then every call record its marker names (those no rollout uses too);
    a run without capture recorded none."""
    if summary.calls_recorded is None:
        return f"{summary.calls} calls, none recorded"
    used = "calls used unknown (a version-1 marker)" if summary.calls is None else f"{summary.calls} calls used"
    return f"{used}, {summary.calls_recorded} recorded"


def failed_lines(summary: ShardSummary) -> list[str]:
    """The shard's failed rollouts by reason and, per leading reason, the first lines of the error most of their
    receipts recorded (an agent's stderr, redacted as recorded); nothing when none failed."""
    if not summary.failed_reasons:
        return []
    lines = [f"  failed rollouts by reason: {_counts(summary.failed_reasons)}"]
    for reason, error in summary.failed_errors.items():
        lines.append(f"  {reason}: the error most of its receipts recorded (reward_info.error):")
        lines += [f"    | {line}" for line in _first_lines(error)]
    return lines


def check_rollouts(summaries: Sequence[ShardSummary]) -> None:
    """Raise :class:`RolloutsFailedError` when every rollout of a shard failed: after its lines and JSON, so that
    ``rollout-ledger generate`` and the Airflow task end with its one line (the leading reasons with counts and
    the first recorded error) and exit 2."""
    failed = [summary for summary in summaries if summary.all_failed]
    if not failed:
        return
    rollouts = sum(summary.rollouts for summary in failed)
    reasons = Counter[str]()
    for summary in failed:
        reasons.update(summary.failed_reasons)
    named = f": {_counts(dict(reasons.most_common()))}" if reasons else ""
    first = next(((reason, error) for s in failed for reason, error in s.failed_errors.items()), None)
    said = f'; {first[0]}: "{_one_line(first[1])}"' if first is not None else ""
    shards = ", ".join(str(summary.shard) for summary in failed)
    raise RolloutsFailedError(
        f"every rollout of shard{'s' if len(failed) > 1 else ''} {shards} failed ({rollouts} rollouts{named}){said}. "
        f"The shard{'s are' if len(failed) > 1 else ' is'} committed and nothing is lost, but there is nothing to "
        "train on, and generating again changes nothing: fix what the failures name (an agent's command, as its "
        "stderr above shows; a scorer; timeout_s) and plan a new batch id"
    )


def summaries_json(summaries: Sequence[ShardSummary]) -> str:
    """The run's stdout: a JSON list with one object per shard (the training signal as ``training_signal``)."""
    return json.dumps([_summary_object(s) for s in summaries], indent=2)


def _summary_object(summary: ShardSummary) -> dict[str, Any]:
    data = asdict(summary)
    data.pop("signal")
    if summary.signal is not None:
        data["training_signal"] = asdict(summary.signal)
    return data


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in counts.items())


def _first_lines(error: str) -> list[str]:
    """The first :data:`ERROR_LINES_SHOWN` lines of ``error`` (each cut), then how many more and the last one."""
    lines = [line.rstrip() for line in error.strip().splitlines()] or [""]
    cut = [line if len(line) <= ERROR_LINE_CHARS else f"{line[:ERROR_LINE_CHARS]}..." for line in lines]
    if len(cut) <= ERROR_LINES_SHOWN:
        return cut
    return [*cut[: ERROR_LINES_SHOWN - 1], f"... {len(cut) - ERROR_LINES_SHOWN} more line(s), the last:", cut[-1]]


def _one_line(error: str) -> str:
    """``error`` on one line: its first line and, when it has more, its last (a traceback's exception)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= ONE_LINE_CHARS else f"{text[:ONE_LINE_CHARS]}..."
