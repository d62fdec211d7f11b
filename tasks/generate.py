"""The generate stage: run one shard's rollouts through the engine, captured (ARCHITECTURE 1, 5, 10).

Reads the batch config and the shard's plan, adopts every rollout an earlier attempt of the
shard already receipted (ok or poisoned: a receipt is final), runs the rest concurrently
(at most ``max_in_flight`` at once, all sharing the engine's continuous batch), writes a
receipt per rollout and then the shard's commit marker, and sweeps orphans. A shard whose
marker exists is not generated again: the committed summary comes back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.capture.hooks import CaptureHooks, RolloutCapture
from tasks.capture.prefix_cache import ChainPrefixCache
from tasks.capture.records import Receipt, canonical_json
from tasks.capture.terminal import attribute_terminal
from tasks.config import BatchConfig
from tasks.engines.base import Engine
from tasks.environments.base import Environment, Turn, check_messages
from tasks.environments.registry import load_environment
from tasks.plan import PlannedRollout, batch_store, read_batch_config, read_shard_plan
from tasks.storage import layout
from tasks.storage.ledger import LedgerWriter, recover_earlier_attempts
from tasks.storage.marker import ShardMarker, read_marker
from tasks.storage.objects import ObjectStore
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import StagingWriter
from tasks.storage.sweep import sweep_orphans

log = logging.getLogger(__name__)
ENVIRONMENT_ERROR = "environment_error"
PROGRESS_LOG_SECONDS = 15.0
# Receipts are made durable at least this often, so a crashed attempt loses little: its
# successor adopts every rollout whose receipt reached storage.
LEDGER_FLUSH_SECONDS = 10.0


@dataclass(frozen=True)
class ShardSummary:
    """What a generate run committed (or found committed)."""

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


def attempts_used(store: ObjectStore, shard: int) -> set[int]:
    """Every attempt that left an object (staging or ledger) for ``shard``."""
    used = set()
    for directory in (layout.staging_shard_dir(shard), layout.ledger_shard_dir(shard)):
        for path in store.list_files(directory):
            try:
                used.add(layout.attempt_of(path))
            except ValueError:  # the shard marker and stray names live outside attempt directories
                continue
    return used


def next_attempt(store: ObjectStore, shard: int) -> int:
    """One past the highest attempt that left any object for ``shard`` (0 when none did)."""
    return max(attempts_used(store, shard), default=-1) + 1


def generate_shard(
    root_url: str,
    batch_id: str,
    shard: int,
    *,
    attempt: int | None = None,
    engine: Engine | None = None,
    run: Callable[[Any], Any] | None = None,
    capture: bool = True,
    progress: bool | None = None,
) -> ShardSummary:
    """Generate and commit ``shard`` of ``batch_id``; see the module docstring.

    With ``engine`` given, ``run`` must execute a coroutine on the loop the engine lives on
    (``BackgroundLoop.run``); otherwise the engine the batch config names is created here and
    shut down before returning.
    """
    store = batch_store(root_url, batch_id)
    config = read_batch_config(store)
    marker = read_marker(store, shard)
    if marker is not None:
        log.info("shard %d of %s is already committed by attempt %d: nothing to do", shard, batch_id, marker.attempt)
        return ShardSummary.of_marker(marker)
    used = attempts_used(store, shard)
    if attempt is None:
        attempt = max(used, default=-1) + 1
    elif attempt in used:
        raise FileExistsError(
            f"attempt {attempt} of shard {shard} already wrote objects; retry with a higher --attempt "
            f"(next unused: {max(used) + 1})"
        )
    plan = read_shard_plan(store, config, shard)
    if engine is not None:
        if run is None:
            raise ValueError("an engine passed in needs `run`, which runs a coroutine on the engine's event loop")
        return run(_run_shard(store, config, shard, attempt, plan, engine, capture=capture, progress=progress))
    return asyncio.run(_with_own_engine(store, config, shard, attempt, plan, capture=capture, progress=progress))


async def _with_own_engine(
    store: ObjectStore, config: BatchConfig, shard: int, attempt: int, plan: list[PlannedRollout], **kwargs: Any
) -> ShardSummary:
    from tasks.engines import create_engine

    engine = await create_engine(config.engine.name, model_path=config.model.path, options=config.engine.options)
    try:
        return await _run_shard(store, config, shard, attempt, plan, engine, **kwargs)
    finally:
        await engine.close()


async def _run_shard(
    store: ObjectStore,
    config: BatchConfig,
    shard: int,
    attempt: int,
    plan: list[PlannedRollout],
    engine: Engine,
    *,
    capture: bool,
    progress: bool | None,
) -> ShardSummary:
    started = time.monotonic()
    recovery = await asyncio.to_thread(recover_earlier_attempts, store, shard, attempt=attempt)
    todo = [p for p in plan if p.rollout_id not in recovery.rollout_ids]
    planned_ids = {p.rollout_id for p in plan}
    stray = sorted(recovery.rollout_ids - planned_ids)
    if stray:
        raise ValueError(f"earlier attempts of shard {shard} receipted rollouts that are not in its plan: {stray[:5]}")
    log.info(
        "shard %d attempt %d: %d rollouts planned, %d adopted from earlier attempts, %d to run",
        shard,
        attempt,
        len(plan),
        len(recovery.rollouts),
        len(todo),
    )
    environment = load_environment(config.environment, config.environment_options)
    staging = StagingWriter(
        store,
        shard=shard,
        attempt=attempt,
        max_rows=config.staging.max_rows,
        max_bytes=config.staging.max_bytes,
        max_delay_ms=config.staging.max_delay_ms,
    )
    ledger = LedgerWriter(store, batch_id=config.batch_id, shard=shard, attempt=attempt, adopted=recovery)
    reader = StagedReader(store)
    cache = ChainPrefixCache()
    hooks = CaptureHooks(
        engine=engine, sampling=config.sampling, staging=staging, ledger=ledger, prefix_cache=cache, capture=capture
    )
    cache.set_source(
        f"{config.batch_id}/shard-{shard}/attempt-{attempt}",
        lambda keys: reader.fetch_token_ids(hooks.coordinates_of(keys)),
    )
    tracker = _Progress(total=len(todo), enabled=progress, label=f"shard {shard}")
    limit = asyncio.Semaphore(config.max_in_flight)
    last_flush = [time.monotonic()]

    async def run_one(planned: PlannedRollout) -> RolloutCapture:
        async with limit:
            state = await _run_rollout(planned, config, attempt, environment, hooks, ledger if capture else None)
        tracker.update(state)
        if capture and time.monotonic() - last_flush[0] >= LEDGER_FLUSH_SECONDS:
            last_flush[0] = time.monotonic()
            await asyncio.to_thread(ledger.flush)
        return state

    try:
        states = await asyncio.gather(*(run_one(p) for p in todo))
    finally:
        await asyncio.to_thread(staging.close)
        tracker.close()
    summary_extra = {
        "generated_tokens": sum(s.generated_tokens for s in states),
        "seconds": time.monotonic() - started,
        "already_committed": False,
    }
    if not capture:
        return ShardSummary(
            batch_id=config.batch_id,
            shard=shard,
            attempt=attempt,
            rollouts=len(states),
            ok=0,
            poisoned=0,
            failed=0,
            adopted=0,
            calls=sum(s.next_ordinal for s in states),
            failures=0,
            swept=0,
            **summary_extra,
        )
    marker = await asyncio.to_thread(ledger.commit, staging_segments=staging.segments)
    report = await asyncio.to_thread(sweep_orphans, store, shard)
    return ShardSummary.of_marker(marker, swept=len(report.deleted), **summary_extra)


async def _run_rollout(
    planned: PlannedRollout,
    config: BatchConfig,
    attempt: int,
    environment: Environment,
    hooks: CaptureHooks,
    ledger: LedgerWriter | None,
) -> RolloutCapture:
    """One episode: model calls and environment turns until done, the turn limit, or a dead end."""
    state = RolloutCapture(batch_id=config.batch_id, rollout_id=planned.rollout_id, attempt=attempt, seed=planned.seed)
    task = json.loads(planned.task_json)
    outcome: Turn | None = None
    error: str | None = None
    try:
        messages = check_messages(environment.initial_messages(task), where=f"{planned.rollout_id} initial messages")
        for _ in range(config.max_turns):
            call = await hooks.call(state, messages)
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
    except Exception as exc:  # an environment bug fails this rollout, never the shard
        log.warning("rollout %s failed in its environment: %r", planned.rollout_id, exc)
        error = f"{type(exc).__name__}: {exc}"
    if ledger is not None:
        receipt = _receipt(planned, state, attempt, outcome, error)
        await asyncio.to_thread(ledger.add_receipt, receipt)
    return state


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
    """A progress bar on a terminal (rollouts, tok/s, failures); periodic log lines otherwise."""

    def __init__(self, *, total: int, enabled: bool | None, label: str) -> None:
        self.total = total
        self.done = 0
        self.failures = 0
        self.tokens = 0
        self.label = label
        self.started = time.monotonic()
        self.last_log = self.started
        interactive = sys.stderr.isatty() if enabled is None else enabled
        self.bar = None
        if interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="rollout", dynamic_ncols=True)

    def update(self, state: RolloutCapture) -> None:
        self.done += 1
        self.tokens += state.generated_tokens
        self.failures += len(state.failures)
        rate = self.tokens / max(time.monotonic() - self.started, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix(tok_s=f"{rate:.0f}", failures=self.failures, refresh=False)
            self.bar.update(1)
        elif time.monotonic() - self.last_log >= PROGRESS_LOG_SECONDS or self.done == self.total:
            self.last_log = time.monotonic()
            log.info(
                "%s: %d/%d rollouts, %.0f generated tok/s, %d failure rows",
                self.label,
                self.done,
                self.total,
                rate,
                self.failures,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
