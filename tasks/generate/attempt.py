"""One attempt per shard not yet committed: claim, adopt, run, commit, sweep.

The attempt claims its number (``_CLAIM.json``, create-once), adopts every rollout an earlier
attempt receipted (a receipt is final; one outside the plan is refused), runs the rest
(:mod:`tasks.generate.rollouts`; those with calls committed earlier resume from them), makes every
buffered receipt durable, and only then writes the shard's commit marker, naming the objects of
earlier attempts its rollouts replayed too, and sweeps orphans. Whatever ends the attempt early, staging is closed
and completed receipts are flushed, and no marker is written. A shard committed meanwhile by
another writer (a zombie and its retry) is not committed twice: the loser returns the winner's
summary.

Failover: when the engine loses one of its replicas and another lives (:meth:`ShardEngine.survives`),
a stepped rollout whose call the lost replica held starts again from its first turn on a live one,
in the same attempt, replaying what it committed (:mod:`tasks.generate.rollouts`); the other
rollouts go on undisturbed. An agent's call cannot be restarted under its running agent: there the
attempt ends as on any engine death, and the shard goes on at once in a new attempt on the live
replicas, adopting what the ended one receipted and resuming the rest. Each replica loss ends an
attempt once at most, so the loop ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

from tasks.errors import EngineDeadError, ObjectConflictError, ShardAlreadyCommittedError
from tasks.generate.checks import CheckedBatch
from tasks.generate.receipts import outcome_of
from tasks.generate.rollouts import RolloutsDone, run_rollouts
from tasks.generate.shard_engine import ShardEngine
from tasks.generate.summary import ShardSummary
from tasks.storage.claims import AttemptClaim, claim_attempt
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.marker import read_marker
from tasks.storage.objects import ObjectStore
from tasks.storage.recovery import carried_files, recover_earlier_attempts
from tasks.storage.staging import StagingWriter
from tasks.storage.sweep import sweep_orphans
from tasks.training_signal import TrainingSignal
from tasks.version import code_version

log = logging.getLogger(__name__)


async def run_shards(batch: CheckedBatch, shards: Sequence[int], engine: ShardEngine) -> list[ShardSummary]:
    """Each of ``shards`` in turn: skipped when committed (now or meanwhile), else claimed and run as a new attempt."""
    for shard in shards:
        marker = batch.committed.get(shard) or await asyncio.to_thread(read_marker, batch.store, shard)
        if marker is not None:
            log.info(
                "shard %d of %s is already committed by attempt %d: nothing to do",
                shard,
                batch.config.batch_id,
                marker.attempt,
            )
            batch.summaries[shard] = ShardSummary.of_marker(marker)
            continue
        batch.summaries[shard] = await run_shard(batch, shard, engine)
    return [batch.summaries[shard] for shard in shards]


async def run_shard(batch: CheckedBatch, shard: int, engine: ShardEngine) -> ShardSummary:
    """Attempts of ``shard`` until one ends: a new one after each failover (see the module docstring)."""
    before = engine.calls_by_replica()
    failovers: list[str] = []
    while True:
        claim = await asyncio.to_thread(
            claim_attempt,
            batch.store,
            batch_id=batch.config.batch_id,
            shard=shard,
            try_number=batch.try_number,
            code_version=code_version(),
        )
        try:
            summary = await run_attempt(batch, claim, engine)
        except EngineDeadError as error:
            if not engine.survives(error):
                raise
            failovers.append(f"attempt {claim.attempt}: {error}")
            log.warning(
                "shard %d attempt %d failed over (%s): the shard goes on in a new attempt on the live servers; "
                "its unreceipted rollouts resume from their committed calls",
                shard,
                claim.attempt,
                error,
            )
            continue
        calls = {name: count - before.get(name, 0) for name, count in engine.calls_by_replica().items()}
        if calls:
            log.info("shard %d: calls answered per server: %s", shard, calls)
        return dataclasses.replace(summary, calls_by_replica=calls, failovers=(*failovers, *summary.failovers))


async def run_attempt(batch: CheckedBatch, claim: AttemptClaim, engine: ShardEngine) -> ShardSummary:
    store, config, shard, attempt = batch.store, batch.config, claim.shard, claim.attempt
    started = time.monotonic()
    try:
        recovery = await asyncio.to_thread(recover_earlier_attempts, store, shard, attempt=attempt)
    except ShardAlreadyCommittedError:
        return await _committed_by_another(store, shard, attempt)
    plan = batch.plans[shard]
    stray = sorted(recovery.rollout_ids - {p.rollout_id for p in plan})
    if stray:
        raise ValueError(f"earlier attempts of shard {shard} receipted rollouts that are not in its plan: {stray[:5]}")
    todo = [p for p in plan if p.rollout_id not in recovery.rollout_ids]
    log.info(
        "shard %d attempt %d: %d rollouts planned, %d adopted from earlier attempts, %d to run",
        shard,
        attempt,
        len(plan),
        len(recovery.rollouts),
        len(todo),
    )
    ledger = LedgerWriter(store, batch_id=config.batch_id, shard=shard, attempt=attempt, adopted=recovery)
    # Call records reach storage after every group commit: a crash loses at most the last commit's calls.
    staging = StagingWriter(
        store,
        shard=shard,
        attempt=attempt,
        max_rows=config.staging.max_rows,
        max_bytes=config.staging.max_bytes,
        max_delay_ms=config.staging.max_delay_ms,
        on_committed=ledger.flush if batch.capture else None,
    )
    try:
        # An attempt that adopts every rollout starts no engine.
        done = RolloutsDone([], 0)
        if todo:
            done = await run_rollouts(batch, claim, todo, engine, staging, ledger, recovery.unreceipted)
    finally:
        await _stop_writers(staging, ledger if batch.capture else None)
    finished = done.finished
    extra = {
        "generated_tokens": sum(f.generated_tokens for f in finished),
        "seconds": time.monotonic() - started,
        "already_committed": False,
        "gateway_auth_failures": done.gateway_auth_failures,
        "failovers": tuple(line for f in finished for line in f.failed_over),
        "resumed": sum(f.resumed for f in finished),
        "replayed_calls": sum(f.replayed_calls for f in finished),
        "live_calls": sum(f.live_calls for f in finished),
        "divergences": sum(f.divergences for f in finished),
    }
    if not batch.capture:
        return ShardSummary(
            batch_id=config.batch_id,
            shard=shard,
            attempt=attempt,
            rollouts=len(finished),
            ok=0,
            poisoned=0,
            failed=0,
            adopted=0,
            calls=sum(f.calls for f in finished),
            failures=0,
            swept=0,
            **extra,
        )
    outcomes = [*(f.outcome for f in finished), *(outcome_of(b.receipt, b.manifest) for b in recovery.rollouts)]
    committed = {c.record.call_id: c for calls in recovery.unreceipted.values() for c in calls}
    replayed = [committed[call_id] for f in finished for call_id in f.carried]
    carried = await asyncio.to_thread(carried_files, store, shard, replayed)
    try:
        marker = await asyncio.to_thread(ledger.commit, staging_segments=staging.segments, carried=carried)
    except ObjectConflictError:
        return await _committed_by_another(store, shard, attempt)
    report = await asyncio.to_thread(sweep_orphans, store, shard)
    return ShardSummary.of_marker(marker, swept=len(report.deleted), signal=TrainingSignal.of(outcomes), **extra)


async def _stop_writers(staging: StagingWriter, ledger: LedgerWriter | None) -> None:
    """Close staging, then make every buffered ledger row durable (receipts of completed rollouts above all)."""
    await asyncio.to_thread(staging.close)
    if ledger is not None:
        await asyncio.to_thread(ledger.flush)


async def _committed_by_another(store: ObjectStore, shard: int, attempt: int) -> ShardSummary:
    marker = await asyncio.to_thread(read_marker, store, shard)
    if marker is None:
        raise RuntimeError(f"shard {shard}: the marker conflicted but cannot be read; run `rollout-ledger status`")
    log.warning(
        "shard %d was committed by attempt %d while attempt %d ran; this attempt's objects are orphans for the sweep",
        shard,
        marker.attempt,
        attempt,
    )
    return ShardSummary.of_marker(marker)
