"""The rollouts of one shard attempt, run concurrently on one engine and captured.

At most ``max_in_flight`` rollouts are in flight at once (the engine's continuous batch). A
rollout that ends, however it ends, gets a receipt (:mod:`tasks.generate.receipts`); receipts
are made durable at least every :data:`LEDGER_FLUSH_SECONDS`. An environment error fails only
its rollout, with the message bounded to :data:`MAX_ERROR_CHARS`. The engine dying or storage
staying unavailable is not a rollout's failure: the rollouts in flight get no receipt (the retry
resumes them) and the attempt ends with that error (the engine's death wins over others).

A rollout an earlier attempt left without a receipt resumes (``resume: turn``): its new episode replays
the calls it committed (:mod:`tasks.generate.resume` finds them, :mod:`tasks.capture.replay` answers
them) and goes on live from the first call that is not among them; so does a stepped rollout
restarted on a live server inside the attempt. With ``resume: restart`` both start from nothing.

An agent environment (:class:`~tasks.environments.agents.Agent`) runs its episodes itself: the
attempt serves a capture gateway on loopback for the time of its rollouts, and each rollout's
agent calls the model through its own route (:mod:`tasks.generate.agent_rollouts`, imported only then:
a stepped environment's attempt loads no gateway, FastAPI or uvicorn).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tasks.batch_fields import RESUME_TURN
from tasks.capture.calls import CallCapture
from tasks.capture.prefix_cache import ChainPrefixCache
from tasks.capture.rollout import RolloutCapture
from tasks.config import BatchConfig
from tasks.environments.agents import Agent
from tasks.environments.base import Environment, Turn, check_messages
from tasks.errors import EngineDeadError, StorageUnavailableError
from tasks.generate.checks import CheckedBatch
from tasks.generate.progress import Progress
from tasks.generate.receipts import outcome_of, receipt_of
from tasks.generate.resume import ResumePoint, resume_points
from tasks.generate.shard_engine import ShardEngine
from tasks.records.ledger import Receipt
from tasks.records.planned import PlannedRollout
from tasks.storage.claims import AttemptClaim
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.recovery import CommittedCall
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import StagingWriter
from tasks.training_signal import RolloutOutcome

if TYPE_CHECKING:
    from tasks.gateway.app import Rollouts

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 2000  # of an environment error kept in a receipt (failure rows keep as much detail)
# Receipts are made durable at least this often, so a crashed attempt loses little: its
# successor adopts every rollout whose receipt reached storage.
LEDGER_FLUSH_SECONDS = 10.0


@dataclass(frozen=True)
class Finished:
    """What the shard keeps of a finished rollout (its tokens are released)."""

    outcome: RolloutOutcome
    generated_tokens: int
    calls: int
    failed_over: tuple[str, ...] = ()  # each restart after its server was lost: "rollout R from call N: why"
    carried: tuple[str, ...] = ()  # its receipt's replayed_calls: calls of earlier attempts in its manifest
    resumed: bool = False  # it began by replaying (or could not replay) what an earlier episode committed
    replayed_calls: int = 0
    live_calls: int = 0  # calls sampled after a replay began
    divergences: int = 0


@dataclass(frozen=True)
class RolloutsDone:
    """What an attempt's rollouts left: each finished rollout, and how many requests its capture gateway
    refused for want of a valid key (0 without an agent; never any rollout's own)."""

    finished: list[Finished]
    gateway_auth_failures: int


async def run_rollouts(
    batch: CheckedBatch,
    claim: AttemptClaim,
    todo: Sequence[PlannedRollout],
    engine: ShardEngine,
    staging: StagingWriter,
    ledger: LedgerWriter,
    unreceipted: Mapping[str, Sequence[CommittedCall]] | None = None,
) -> RolloutsDone:
    """Run ``todo`` on ``engine`` (started if it is not yet), at most ``max_in_flight`` at once, captured;
    ``unreceipted``: the calls earlier attempts committed of rollouts without a receipt (recovery's), to resume."""
    config, shard, attempt = batch.config, claim.shard, claim.attempt
    agent = batch.environment if isinstance(batch.environment, Agent) else None
    reader = StagedReader(batch.store)
    cache = ChainPrefixCache()
    # An agent's calls arrive over HTTP on this loop: their prompts are rendered in one thread of their own.
    renderer = ThreadPoolExecutor(1, thread_name_prefix="render") if agent is not None else None
    capture = CallCapture(
        engine=await engine.get(),
        sampling=config.sampling,
        staging=staging,
        ledger=ledger,
        prefix_cache=cache,
        capture=batch.capture,
        render_executor=renderer,
    )
    cache.set_source(
        f"{config.batch_id}/shard-{shard}/attempt-{attempt}",
        lambda keys: reader.fetch_token_ids(capture.coordinates_of(keys)),
    )
    points: dict[str, ResumePoint] = {}
    if batch.capture and config.resume == RESUME_TURN and unreceipted:
        points = await resume_points(unreceipted, (p.rollout_id for p in todo), reader, capture.decode)
        if points:
            log.info(
                "shard %d attempt %d: %d rollout(s) resume from calls committed before", shard, attempt, len(points)
            )
    progress = Progress(total=len(todo), enabled=batch.progress, label=f"shard {shard}", every_s=batch.progress_every_s)
    limit = asyncio.Semaphore(min(config.max_in_flight, (agent and agent.max_concurrency) or config.max_in_flight))
    finished: list[Finished] = []
    last_flush = [time.monotonic()]
    ledger_or_none = ledger if batch.capture else None

    async with _episodes(batch, agent, capture, progress, engine) as (run_episode, gateway):

        async def run_one(planned: PlannedRollout) -> None:
            graph = config.message_graph if agent is not None else None
            state = rollout_state(planned, config, attempt, points.get(planned.rollout_id), message_graph=graph)
            async with limit:
                done = await run_episode(planned, state, ledger_or_none)
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
            raise first_error(failed) from None
        finally:
            heartbeat.cancel()
            progress.close()
            if renderer is not None:
                renderer.shutdown(wait=False, cancel_futures=True)
    return RolloutsDone(finished, gateway.auth_failures if gateway is not None else 0)


Episode = Callable[[PlannedRollout, RolloutCapture, LedgerWriter | None], Awaitable[Finished]]


def rollout_state(
    planned: PlannedRollout,
    config: BatchConfig,
    attempt: int,
    point: ResumePoint | None,
    *,
    message_graph: str | None = None,
) -> RolloutCapture:
    """The capture state a rollout starts with: resuming at ``point`` (in the episode after its book's) when given;
    ``message_graph``: an agent's (see :class:`RolloutCapture`)."""
    state = RolloutCapture(
        batch_id=config.batch_id,
        rollout_id=planned.rollout_id,
        attempt=attempt,
        seed=planned.seed,
        message_graph=message_graph,
        resume=config.resume == RESUME_TURN,
    )
    if point is not None:
        if point.problem is not None:
            log.warning("rollout %s starts from its first turn: %s", planned.rollout_id, point.problem)
            state.could_not_replay(point.problem)
        state.begin_episode(point.entries, point.episode + 1)
    return state


@contextlib.asynccontextmanager
async def _episodes(
    batch: CheckedBatch, agent: Agent | None, capture: CallCapture, progress: Progress, engine: ShardEngine
) -> AsyncIterator[tuple[Episode, Rollouts | None]]:
    """How this attempt runs one rollout: stepping its environment, or its agent behind a gateway served meanwhile
    (yielded with it)."""
    config = batch.config
    if agent is None:
        environment = batch.environment
        assert isinstance(environment, Environment)

        async def stepped(planned: PlannedRollout, state: RolloutCapture, ledger: LedgerWriter | None) -> Finished:
            while True:
                try:
                    return await run_rollout(planned, config, state, environment, capture, ledger, progress)
                except EngineDeadError as error:
                    if not engine.survives(error):
                        raise
                    log.warning(
                        "rollout %s lost its server (%s): it starts again from its first turn on a live one, %s",
                        planned.rollout_id,
                        error,
                        "replaying the calls it committed" if state.resume else "its calls so far left unused",
                    )
                    state.restart(f"from call {state.next_ordinal}: {error}")

        yield stepped, None
        return
    # The gateway (FastAPI, uvicorn) is imported only where an agent runs.
    from tasks.gateway.app import Rollouts
    from tasks.gateway.server import serving
    from tasks.generate.agent_rollouts import GatewayCalls, run_agent_rollout

    gateway = Rollouts(model=config.model.reference)
    calls = GatewayCalls(capture, progress)
    try:
        async with serving(gateway) as base_url:

            async def agent_episode(
                planned: PlannedRollout, state: RolloutCapture, ledger: LedgerWriter | None
            ) -> Finished:
                receipt = await run_agent_rollout(planned, config, state, agent, calls, gateway, base_url)
                return await _finished(receipt, state, capture, ledger)

            yield agent_episode, gateway
    finally:
        agent.close()


def first_error(group: BaseExceptionGroup) -> BaseException:
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


async def run_rollout(
    planned: PlannedRollout,
    config: BatchConfig,
    state: RolloutCapture,
    environment: Environment,
    capture: CallCapture,
    ledger: LedgerWriter | None,
    progress: Progress,
) -> Finished:
    """One episode from its first turn, captured in ``state``: model calls and environment turns until done, the
    turn limit, or a dead end."""
    task = json.loads(planned.task_json)
    outcome: Turn | None = None
    error: str | None = None
    try:
        messages = check_messages(environment.initial_messages(task), where=f"{planned.rollout_id} initial messages")
        for _ in range(config.max_turns):
            call = await capture.call(state, messages)
            sampled = 0 if call.completion is None or call.replayed else len(call.completion.token_ids)
            progress.call_done(sampled, call.failure is not None)
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
        raise  # the engine's or the storage's failure, not this rollout's: no receipt, the retry resumes it
    except Exception as exc:  # an environment bug fails this rollout, never the shard
        error = f"{type(exc).__name__}: {exc}"
        if len(error) > MAX_ERROR_CHARS:  # an environment's message may be huge: bounded in the receipt and the log
            error = f"{error[:MAX_ERROR_CHARS]}... ({len(error)} characters)"
        log.warning("rollout %s failed in its environment: %s", planned.rollout_id, error)
    return await _finished(receipt_of(planned, state, outcome, error), state, capture, ledger)


async def _finished(
    receipt: Receipt, state: RolloutCapture, capture: CallCapture, ledger: LedgerWriter | None
) -> Finished:
    """Hand a finished rollout's receipt to the ledger and release what it held."""
    if ledger is not None:
        await asyncio.to_thread(ledger.add_receipt, receipt)
    capture.release(state)
    return Finished(
        outcome=outcome_of(receipt, state.records),
        generated_tokens=state.generated_tokens,
        calls=state.next_ordinal,
        failed_over=tuple(f"rollout {state.rollout_id} {why}" for why in state.failed_over),
        carried=receipt.replayed_calls,
        resumed=state.episode > 0,
        replayed_calls=state.replayed_calls,
        live_calls=state.live_calls,
        divergences=state.divergences,
    )
