"""The generate stage's entry points: :func:`generate_shards` and :func:`generate_shard`.

Checks come first (:mod:`tasks.generate.checks`), then the shards run one after another on one
engine (:mod:`tasks.generate.attempt`). With its own engine, the stage runs its own event loop,
shuts the engine down on every path, and turns an interruption (SIGTERM, SIGINT) into
:class:`~tasks.errors.GenerateInterrupted` naming the shards left unfinished. A shard with failed
rollouts is returned with why they failed, read back from its committed receipts
(:func:`~tasks.generate.summary.with_failed_rollouts`); what a front-end does with a shard whose every
rollout failed is its own (:func:`tasks.generate.console.check_rollouts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from tasks.batch import Batch
from tasks.engines.base import Engine
from tasks.environments.registry import Runnables
from tasks.errors import GenerateInterrupted, LedgerError
from tasks.generate.attempt import run_shards
from tasks.generate.checks import CheckedBatch, check_before_engine, check_engine_version
from tasks.generate.progress import heartbeat_seconds
from tasks.generate.shard_engine import ShardEngine
from tasks.generate.signals import StopSignals
from tasks.generate.summary import ShardSummary, with_failed_rollouts

log = logging.getLogger(__name__)
Runner = Callable[[Coroutine[Any, Any, Any]], Any]


def generate_shard(batch: Batch, shard: int, **kwargs: Any) -> ShardSummary:
    """Generate and commit one shard; see :func:`generate_shards`."""
    return generate_shards(batch, [shard], **kwargs)[0]


def generate_shards(
    batch: Batch,
    shards: Sequence[int],
    *,
    engine: Engine | None = None,
    run: Runner | None = None,
    capture: bool = True,
    progress: bool | None = None,
    try_number: int | None = None,
    on_engine_start: Callable[[float], contextlib.AbstractContextManager[Any]] | None = None,
    runnables: Runnables | None = None,
) -> list[ShardSummary]:
    """Generate and commit ``shards`` of ``batch`` one after another on one engine; see :mod:`tasks.generate`.

    With ``engine`` given, ``run`` must execute a coroutine on the loop the engine lives on
    (``BackgroundLoop.run``) and the engine must serve at least the planned weight version;
    otherwise the engine the batch config names is created at the planned weight version when an
    attempt first has a rollout to run (never, when earlier attempts receipted them all), and
    shut down before returning, on every path. ``on_engine_start(expected_seconds)`` wraps the
    engine's whole life (the CLI prints a notice and redirects engine output there).
    ``try_number`` (the orchestrator's) is recorded in each attempt's claim. ``runnables`` says what
    the batch's environment may be (a triggered batch's workers: :meth:`Runnables.triggered`).
    """
    work = check_before_engine(batch, shards, own_engine=engine is None, runnables=runnables)
    work.try_number, work.capture, work.progress = try_number, capture, progress
    work.progress_every_s = heartbeat_seconds()
    if all(shard in work.committed for shard in shards):
        summaries = [ShardSummary.of_marker(work.committed[shard]) for shard in shards]
    elif engine is not None:
        if run is None:
            raise ValueError("an engine passed in needs `run`, which runs a coroutine on the engine's event loop")
        check_engine_version(engine, work.config)
        summaries = run(run_shards(work, shards, ShardEngine(work.config, engine=engine)))
    else:
        summaries = _with_own_engine(work, shards, on_engine_start)
    return [_why_failed(batch, summary) if summary.failed else summary for summary in summaries]


def _why_failed(batch: Batch, summary: ShardSummary) -> ShardSummary:
    """``summary`` with its failed rollouts by reason and their recorded errors, read from the committed receipts
    (this run's and earlier attempts' alike); as it was when they cannot be read (it only informs)."""
    try:
        receipts = batch.ledger(summary.shard).receipts
    except (LedgerError, OSError) as error:
        log.warning(
            "shard %d: its receipts could not be read back to say why rollouts failed: %s", summary.shard, error
        )
        return summary
    return with_failed_rollouts(summary, receipts)


def _with_own_engine(
    batch: CheckedBatch, shards: Sequence[int], on_engine_start: Callable[[float], Any] | None
) -> list[ShardSummary]:
    stop = StopSignals()
    try:
        return asyncio.run(_serve_with_own_engine(batch, shards, stop, on_engine_start))
    except BaseException as exc:
        # Ctrl-C reaches the engine's processes too: whatever broke first, a signal stopped us.
        if stop.signum is None:
            raise
        raise GenerateInterrupted(stop.signum, [s for s in shards if s not in batch.summaries]) from exc


async def _serve_with_own_engine(
    batch: CheckedBatch, shards: Sequence[int], stop: StopSignals, on_engine_start: Callable[[float], Any] | None
) -> list[ShardSummary]:
    engine = ShardEngine(batch.config, on_start=on_engine_start, model_folder=batch.model_folder)
    with stop.cancelling(asyncio.current_task()):
        try:
            return await run_shards(batch, shards, engine)
        finally:
            await engine.close()
