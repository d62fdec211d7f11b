"""The generate stage: run shards' rollouts through one engine, captured (ARCHITECTURE 1, 5, 10).

Before any engine starts, everything a user can get wrong is checked (fail fast): the batch
config, the shards and their plans, the environment and its prompt file, and the model the
worker resolves from the plan's portable reference, whose hashes must equal the planned ones.

Each shard not yet committed then runs as a new attempt: it claims the attempt
(``_CLAIM.json``, create-once), adopts every rollout an earlier attempt receipted (a receipt is
final), runs the rest concurrently (at most ``max_in_flight`` at once in the engine's
continuous batch), writes a receipt per rollout and then the shard's commit marker, and sweeps
orphans. The engine starts when the first attempt has a rollout to run: a retry after a crash at
commit time, which adopts every rollout, commits without one. A shard committed meanwhile by
another writer (a zombie and its retry) is not committed twice: the loser returns the winner's
summary.

An interruption (SIGTERM, SIGINT) or the engine dying ends the attempt: receipts of completed
rollouts are flushed (the retry adopts them), rollouts in flight get no receipt (the retry
re-runs them), no marker is written, the engine is shut down, and the caller gets
:class:`GenerateInterrupted` or :class:`~tasks.engines.base.EngineDeadError`. Storage that stays
unavailable through an operation's retries ends the attempt the same way, with
:class:`~tasks.errors.StorageUnavailableError` (the flush of receipts may fail with it too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.batch import Batch
from tasks.capture.calls import CallCapture, RolloutCapture
from tasks.capture.prefix_cache import ChainPrefixCache
from tasks.capture.terminal import attribute_terminal
from tasks.config import BatchConfig
from tasks.engines.base import Engine
from tasks.environments.base import Environment, Turn, check_messages
from tasks.environments.registry import load_environment
from tasks.errors import (
    ConfigError,
    EngineDeadError,
    GenerateInterrupted,
    ObjectConflictError,
    ShardAlreadyCommittedError,
    StorageUnavailableError,
)
from tasks.records.ledger import CallRecord, Receipt, canonical_json
from tasks.records.planned import PlannedRollout
from tasks.storage.claims import AttemptClaim, claim_attempt
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.marker import ShardMarker, read_marker
from tasks.storage.objects import ObjectStore
from tasks.storage.recovery import recover_earlier_attempts
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import StagingWriter
from tasks.storage.sweep import sweep_orphans
from tasks.training_signal import RolloutOutcome, TrainingSignal
from tasks.version import code_version

log = logging.getLogger(__name__)
ENVIRONMENT_ERROR = "environment_error"
MAX_ERROR_CHARS = 2000  # of an environment error kept in a receipt (failure rows keep as much detail)
HEARTBEAT_SECONDS = 10.0
# Receipts are made durable at least this often, so a crashed attempt loses little: its
# successor adopts every rollout whose receipt reached storage.
LEDGER_FLUSH_SECONDS = 10.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
Runner = Callable[[Coroutine[Any, Any, Any]], Any]


@dataclass(frozen=True)
class ShardSummary:
    """What a generate run committed (or found committed), and the training signal of what it ran."""

    batch_id: str
    shard: int
    attempt: int
    rollouts: int
    ok: int
    poisoned: int
    failed: int
    adopted: int
    calls: int
    failures: int
    generated_tokens: int
    seconds: float
    already_committed: bool
    swept: int
    signal: TrainingSignal | None = None

    @classmethod
    def of_marker(cls, marker: ShardMarker, **extra: Any) -> ShardSummary:
        counts = marker.counts
        return cls(
            batch_id=marker.batch_id,
            shard=marker.shard,
            attempt=marker.attempt,
            rollouts=counts.rollouts,
            ok=counts.ok,
            poisoned=counts.poisoned,
            failed=counts.failed,
            adopted=counts.adopted_rollouts,
            calls=counts.calls,
            failures=counts.failures,
            **({"generated_tokens": 0, "seconds": 0.0, "already_committed": True, "swept": 0} | extra),
        )


@dataclass
class _Batch:
    """What generate checked before starting an engine: one batch, the shards still to run."""

    store: ObjectStore
    config: BatchConfig
    environment: Environment
    plans: dict[int, list[PlannedRollout]]
    committed: dict[int, ShardMarker]
    model_folder: Path | None = None
    try_number: int | None = None
    capture: bool = True
    progress: bool | None = None
    summaries: dict[int, ShardSummary] = field(default_factory=dict)


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
) -> list[ShardSummary]:
    """Generate and commit ``shards`` of ``batch`` one after another on one engine; see the module docstring.

    With ``engine`` given, ``run`` must execute a coroutine on the loop the engine lives on
    (``BackgroundLoop.run``) and the engine must serve at least the planned weight version;
    otherwise the engine the batch config names is created at the planned weight version when an
    attempt first has a rollout to run (never, when earlier attempts receipted them all), and
    shut down before returning, on every path. ``on_engine_start(expected_seconds)`` wraps the
    engine's whole life (the CLI prints a notice and redirects engine output there).
    ``try_number`` (the orchestrator's) is recorded in each attempt's claim.
    """
    work = _check_before_engine(batch, shards, own_engine=engine is None)
    work.try_number, work.capture, work.progress = try_number, capture, progress
    if all(shard in work.committed for shard in shards):
        return [ShardSummary.of_marker(work.committed[shard]) for shard in shards]
    if engine is not None:
        if run is None:
            raise ValueError("an engine passed in needs `run`, which runs a coroutine on the engine's event loop")
        _check_engine_version(engine, work.config)
        return run(_run_shards(work, shards, _ShardEngine(work.config, engine=engine)))
    return _with_own_engine(work, shards, on_engine_start)


def _check_before_engine(batch: Batch, shards: Sequence[int], *, own_engine: bool) -> _Batch:
    """Everything that can be checked without an engine; a clear error before minutes of engine start."""
    from tasks.models.reference import check_provenance, resolve_model_reference

    if not shards:
        raise ConfigError("no shard to generate: name at least one")
    if len(set(shards)) != len(shards):
        raise ConfigError(f"shards {list(shards)} name a shard twice")
    config = batch.config
    committed = {}
    plans = {}
    for shard in shards:
        marker = batch.shard_marker(shard) if 0 <= shard < config.shards else None
        if marker is not None:
            committed[shard] = marker
        else:
            plans[shard] = batch.shard_plan(shard)
    environment = load_environment(config.environment, config.environment_options)
    work = _Batch(store=batch.store, config=config, environment=environment, plans=plans, committed=committed)
    if own_engine and plans:
        folder = resolve_model_reference(config.model.reference)
        check_provenance(folder, config.model.provenance, reference=config.model.reference)
        work.model_folder = folder
    return work


def _check_engine_version(engine: Engine, config: BatchConfig) -> None:
    if engine.weight_version < config.weight_version:
        raise ConfigError(
            f"the engine serves weight version {engine.weight_version}, older than the planned "
            f"{config.weight_version}: refit it to the planned weights first"
        )


def _with_own_engine(
    batch: _Batch, shards: Sequence[int], on_engine_start: Callable[[float], Any] | None
) -> list[ShardSummary]:
    stop = _StopSignals()
    try:
        return asyncio.run(_serve_with_own_engine(batch, shards, stop, on_engine_start))
    except BaseException as exc:
        # Ctrl-C reaches the engine's processes too: whatever broke first, a signal stopped us.
        if stop.signum is None:
            raise
        raise GenerateInterrupted(stop.signum, [s for s in shards if s not in batch.summaries]) from exc


async def _serve_with_own_engine(
    batch: _Batch, shards: Sequence[int], stop: _StopSignals, on_engine_start: Callable[[float], Any] | None
) -> list[ShardSummary]:
    engine = _ShardEngine(batch.config, on_start=on_engine_start, model_folder=batch.model_folder)
    with stop.cancelling(asyncio.current_task()):
        try:
            return await _run_shards(batch, shards, engine)
        finally:
            await engine.close()


class _ShardEngine:
    """The engine the shards run on: one passed in, or the batch's own, started the first time an
    attempt has a rollout to run (a retry that adopts every rollout starts none) and shut down by
    :meth:`close`, with ``on_start(expected_seconds)`` entered before it starts and left after."""

    def __init__(
        self,
        config: BatchConfig,
        *,
        engine: Engine | None = None,
        on_start: Callable[[float], contextlib.AbstractContextManager[Any]] | None = None,
        model_folder: Path | None = None,
    ) -> None:
        self._config, self._engine, self._own = config, engine, engine is None
        self._on_start, self._model_folder = on_start, model_folder
        self._context = contextlib.ExitStack()

    async def get(self) -> Engine:
        if self._engine is None:
            self._engine = await self._start()
        return self._engine

    async def _start(self) -> Engine:
        from tasks.engines import create_engine
        from tasks.engines.startup import expected_start_seconds, record_start_seconds

        config = self._config
        if self._on_start is not None:
            self._context.enter_context(self._on_start(expected_start_seconds(config.engine.name)))
        started = time.monotonic()
        log.info("starting the %s engine on %s", config.engine.name, config.model.reference)
        engine = await create_engine(
            config.engine.name,
            model_path=self._model_folder,  # type: ignore[arg-type]
            options=config.engine.options,
            weight_version=config.weight_version,
        )
        record_start_seconds(config.engine.name, time.monotonic() - started)
        log.info("engine started in %.0f s", time.monotonic() - started)
        return engine

    async def close(self) -> None:
        """Shut down an engine this started (one passed in stays up); leave ``on_start``'s context."""
        try:
            if self._own and self._engine is not None:
                await self._engine.close()
        finally:
            self._context.close()


class _StopSignals:
    """SIGTERM and SIGINT cancel the stage's main task once (later signals only log); previous handlers come back.

    Installed only on the main thread (where Python delivers signals); the signal number is kept
    so the caller can say which one stopped it.
    """

    def __init__(self) -> None:
        self.signum: int | None = None

    @contextlib.contextmanager
    def cancelling(self, task: asyncio.Task[Any] | None) -> Iterator[None]:
        if task is None or threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

        def stop(signum: int) -> None:
            if self.signum is not None:
                log.warning("%s received while stopping: still flushing and shutting down", signal.Signals(signum).name)
                return
            self.signum = signum
            log.warning("%s received: flushing completed rollouts and shutting down", signal.Signals(signum).name)
            task.cancel()

        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, stop, signum)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                loop.remove_signal_handler(signum)
                signal.signal(signum, handler)


async def _run_shards(batch: _Batch, shards: Sequence[int], engine: _ShardEngine) -> list[ShardSummary]:
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
        claim = await asyncio.to_thread(
            claim_attempt,
            batch.store,
            batch_id=batch.config.batch_id,
            shard=shard,
            try_number=batch.try_number,
            code_version=code_version(),
        )
        batch.summaries[shard] = await _run_attempt(batch, claim, engine)
    return [batch.summaries[shard] for shard in shards]


@dataclass(frozen=True)
class _Finished:
    """What the shard keeps of a finished rollout (its tokens are released)."""

    outcome: RolloutOutcome
    generated_tokens: int
    calls: int


async def _run_attempt(batch: _Batch, claim: AttemptClaim, engine: _ShardEngine) -> ShardSummary:
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
    staging = StagingWriter(
        store,
        shard=shard,
        attempt=attempt,
        max_rows=config.staging.max_rows,
        max_bytes=config.staging.max_bytes,
        max_delay_ms=config.staging.max_delay_ms,
    )
    ledger = LedgerWriter(store, batch_id=config.batch_id, shard=shard, attempt=attempt, adopted=recovery)
    try:
        # An attempt that adopts every rollout starts no engine.
        finished = await _run_rollouts(batch, claim, todo, engine, staging, ledger) if todo else []
    finally:
        await _stop_writers(staging, ledger if batch.capture else None)
    extra = {
        "generated_tokens": sum(f.generated_tokens for f in finished),
        "seconds": time.monotonic() - started,
        "already_committed": False,
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
    outcomes = [*(f.outcome for f in finished), *(_outcome(b.receipt, b.manifest) for b in recovery.rollouts)]
    try:
        marker = await asyncio.to_thread(ledger.commit, staging_segments=staging.segments)
    except ObjectConflictError:
        return await _committed_by_another(store, shard, attempt)
    report = await asyncio.to_thread(sweep_orphans, store, shard)
    return ShardSummary.of_marker(marker, swept=len(report.deleted), signal=TrainingSignal.of(outcomes), **extra)


async def _run_rollouts(
    batch: _Batch,
    claim: AttemptClaim,
    todo: Sequence[PlannedRollout],
    engine: _ShardEngine,
    staging: StagingWriter,
    ledger: LedgerWriter,
) -> list[_Finished]:
    """Run ``todo`` on ``engine`` (started if it is not yet), at most ``max_in_flight`` at once, captured."""
    config, shard, attempt = batch.config, claim.shard, claim.attempt
    reader = StagedReader(batch.store)
    cache = ChainPrefixCache()
    capture = CallCapture(
        engine=await engine.get(),
        sampling=config.sampling,
        staging=staging,
        ledger=ledger,
        prefix_cache=cache,
        capture=batch.capture,
    )
    cache.set_source(
        f"{config.batch_id}/shard-{shard}/attempt-{attempt}",
        lambda keys: reader.fetch_token_ids(capture.coordinates_of(keys)),
    )
    progress = _Progress(total=len(todo), enabled=batch.progress, label=f"shard {shard}")
    limit = asyncio.Semaphore(config.max_in_flight)
    finished: list[_Finished] = []
    last_flush = [time.monotonic()]

    async def run_one(planned: PlannedRollout) -> None:
        async with limit:
            done = await _run_rollout(
                planned, config, attempt, batch.environment, capture, ledger if batch.capture else None, progress
            )
        finished.append(done)
        progress.rollout_done()
        if batch.capture and time.monotonic() - last_flush[0] >= LEDGER_FLUSH_SECONDS:
            last_flush[0] = time.monotonic()
            await asyncio.to_thread(ledger.flush)

    heartbeat = asyncio.create_task(progress.heartbeat())
    try:
        async with asyncio.TaskGroup() as group:
            for planned in todo:
                group.create_task(run_one(planned))
    except BaseExceptionGroup as failed:
        raise _first_error(failed) from None
    finally:
        heartbeat.cancel()
        progress.close()
    return finished


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


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The exception to report from a task group: the engine dying wins, else the first one."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        error = pending.pop(0)
        if isinstance(error, BaseExceptionGroup):
            pending.extend(error.exceptions)
        else:
            leaves.append(error)
    return next((e for e in leaves if isinstance(e, EngineDeadError)), leaves[0])


async def _run_rollout(
    planned: PlannedRollout,
    config: BatchConfig,
    attempt: int,
    environment: Environment,
    capture: CallCapture,
    ledger: LedgerWriter | None,
    progress: _Progress,
) -> _Finished:
    """One episode: model calls and environment turns until done, the turn limit, or a dead end."""
    state = RolloutCapture(batch_id=config.batch_id, rollout_id=planned.rollout_id, attempt=attempt, seed=planned.seed)
    task = json.loads(planned.task_json)
    outcome: Turn | None = None
    error: str | None = None
    try:
        messages = check_messages(environment.initial_messages(task), where=f"{planned.rollout_id} initial messages")
        for _ in range(config.max_turns):
            call = await capture.call(state, messages)
            progress.call_done(
                0 if call.completion is None else len(call.completion.token_ids), call.failure is not None
            )
            if call.completion is None:
                break  # no completion to continue from: the rollout is poisoned by the call's failure row
            messages = [*messages, {"role": "assistant", "content": call.completion.text}]
            turn = environment.step(task, messages)
            if turn.done:
                outcome = turn
                break
            nxt = list(turn.rewrite) if turn.rewrite is not None else [*messages, *turn.messages]
            messages = check_messages(nxt, where=f"{planned.rollout_id} turn {state.next_ordinal}")
        else:
            outcome = environment.finish_unfinished(task, messages)
    except (EngineDeadError, StorageUnavailableError):
        raise  # the engine's or the storage's failure, not this rollout's: no receipt, the retry re-runs it
    except Exception as exc:  # an environment bug fails this rollout, never the shard
        error = f"{type(exc).__name__}: {exc}"
        if len(error) > MAX_ERROR_CHARS:  # an environment's message may be huge: bounded in the receipt and the log
            error = f"{error[:MAX_ERROR_CHARS]}... ({len(error)} characters)"
        log.warning("rollout %s failed in its environment: %s", planned.rollout_id, error)
    receipt = _receipt(planned, state, attempt, outcome, error)
    if ledger is not None:
        await asyncio.to_thread(ledger.add_receipt, receipt)
    capture.release(state)
    return _Finished(
        outcome=_outcome(receipt, state.records),
        generated_tokens=state.generated_tokens,
        calls=state.next_ordinal,
    )


def _outcome(receipt: Receipt, manifest: Sequence[CallRecord]) -> RolloutOutcome:
    """What the training-signal summary needs of a receipted rollout (truncated: its terminal hit max_tokens)."""
    terminal = next((c for c in manifest if c.call_id == receipt.terminal_call_id), None)
    return RolloutOutcome(
        group_id=receipt.group_id,
        status=receipt.status,
        reward=receipt.reward,
        failure_reason=receipt.failure_reason,
        truncated=terminal is not None and terminal.finish_reason == "length",
    )


def _receipt(
    planned: PlannedRollout, state: RolloutCapture, attempt: int, outcome: Turn | None, error: str | None
) -> Receipt:
    """The rollout's final word. The declared terminal is the episode's last captured call."""
    reward = outcome.reward if outcome is not None else None
    info = dict(outcome.reward_info) if outcome is not None else {}
    if error is not None:
        info["error"] = error
    common = {
        "rollout_id": planned.rollout_id,
        "group_id": planned.group_id,
        "attempt": attempt,
        "reward": reward,
        "reward_info": canonical_json(info),
        "num_calls": len(state.records),
    }
    unfinished = {"terminal_call_id": None, "terminal_selection": None, "terminal_attribution_reason": None}
    if error is not None:
        return Receipt(**common, **unfinished, status="failed", failure_reason=ENVIRONMENT_ERROR)
    if state.poisoned_reason is not None:
        return Receipt(**common, **unfinished, status="poisoned", failure_reason=state.poisoned_reason)
    attribution = attribute_terminal(state.records, declared_call_id=state.last_captured_call_id)
    if attribution.terminal_call_id is None or reward is None:
        reason = attribution.reason if attribution.terminal_call_id is None else "no_reward"
        return Receipt(**common, **unfinished, status="poisoned", failure_reason=reason)
    return Receipt(
        **common,
        terminal_call_id=attribution.terminal_call_id,
        terminal_selection=attribution.selection_method,
        terminal_attribution_reason=attribution.reason,
        status="ok",
        failure_reason=None,
    )


class _Progress:
    """Progress per model call: a bar on a terminal (rollouts, calls, tok/s, failures), log lines otherwise.

    :meth:`heartbeat` keeps both alive while nothing finishes: the bar's clock ticks every second
    and a log line is written at least every :data:`HEARTBEAT_SECONDS`.
    """

    def __init__(self, *, total: int, enabled: bool | None, label: str) -> None:
        self.total = total
        self.done = 0
        self.calls = 0
        self.failures = 0
        self.tokens = 0
        self.label = label
        self.started = time.monotonic()
        interactive = sys.stderr.isatty() if enabled is None else enabled
        self.bar = None
        if interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="rollout", dynamic_ncols=True, file=sys.stderr)

    def call_done(self, tokens: int, failed: bool) -> None:
        self.calls += 1
        self.tokens += tokens
        self.failures += int(failed)
        if self.bar is not None:
            self.bar.set_postfix(calls=self.calls, tok_s=f"{self._rate():.0f}", failures=self.failures, refresh=False)
            self.bar.refresh()

    def rollout_done(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(1.0 if self.bar is not None else HEARTBEAT_SECONDS)
            if self.bar is not None:
                self.bar.refresh()
            else:
                self.log()

    def log(self) -> None:
        log.info(
            "%s: %d/%d rollouts done, %d calls, %d tokens (%.0f tok/s), %d failure rows, %.0f s",
            self.label,
            self.done,
            self.total,
            self.calls,
            self.tokens,
            self._rate(),
            self.failures,
            time.monotonic() - self.started,
        )

    def _rate(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self.log()
