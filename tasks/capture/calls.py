"""Engine-agnostic call capture: one model call, captured (docs/architecture.md §5).

:class:`CallCapture.call` runs the steps of one call in order: admission (parent chain,
weight version, ``admitted_at``), prompt preparation (parent tokens through the
:class:`ChainPrefixCache`, chat render, splice, the prompt must start with the parent's exact
tokens), generation on token ids, staging of the delta (group commit, awaited), and only then
the ledger call record. A child is admitted only after its parent's record was handed to the
ledger, which writes a rollout's receipt only after all of its records are durable.

Every failure writes a failure row with a named reason (``FAILURE_REASONS``) and poisons the
rollout (a step that fails for a reason of its own raises :class:`~tasks.capture.faults.CallFault`:
the chat template, the tokenizer, the gateway's reply reader); the environment still gets the
completion when one exists (a capture failure is not a generation failure), and later calls of a
poisoned rollout run uncaptured. The engine dying (:class:`EngineDeadError`) and storage staying
unavailable through every retry (:class:`StorageUnavailableError`) are no failures of the call:
they propagate and end the shard attempt, and the retry re-runs the rollout.
With ``capture=False`` the same path runs minus staging and ledger (the overhead benchmark).

A rollout's calls form a chain by default: each call must extend the previous one's conversation
(else ``history_diverged``). With ``RolloutCapture.message_graph`` (the gateway's agents) set to
``splice``, each call's parent is the earlier call its history extends (:mod:`tasks.capture.graph`),
and a call that extends none (or offers other tools than the one it extends) is a new root whose
reason is staged in its extras (``{"gateway": {"root_reason": ...}}``); with ``independent`` every
call is a root.

With a ``render_executor`` (the gateway's: its calls arrive over HTTP on the loop), all of the
capture's tokenizer work (render, encode, reading the reply) runs on that one thread, with a
private copy of the engine's tokenizer (:attr:`CallCapture.tokenizer`): an engine may decode with
its own on the loop meanwhile (``vllm_server`` does), and a Hugging Face tokenizer must not be
used by two threads at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from tasks import ids
from tasks.capture.faults import TEMPLATE_ERROR, TOKENIZER_ERROR, CallFault, RenderTokenizer
from tasks.capture.graph import (
    INDEPENDENT,
    CanonicalMessage,
    canonical_conversation,
    find_parent,
    root_reason,
    tools_key,
)
from tasks.capture.prefix_cache import (
    Admission,
    ChainPrefixCache,
    PrefixMismatchError,
    resolve_admission,
    resolve_cached_admission,
)
from tasks.capture.splice import ChatPromptBuilder
from tasks.capture.terminal import fingerprint_content
from tasks.crash_points import crash_point
from tasks.engines.base import SERVED_BY, Engine, GenerationRequest, GenerationResult, SamplingSettings
from tasks.environments.base import Message
from tasks.errors import EngineDeadError, StorageUnavailableError
from tasks.records.ledger import CallRecord, FailureRow, StagedDelta
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.staging import CommitCoordinates, StagingWriter

HISTORY_DIVERGED = "history_diverged"
PREFIX_MISMATCH = "prefix_mismatch"
SPLICE_FAILED = "splice_failed"
CONTEXT_LENGTH = "context_length"
ENGINE_ERROR = "engine_error"
ENGINE_PROMPT_MISMATCH = "engine_prompt_mismatch"
INVALID_DELTA = "invalid_delta"
STAGING_FAILED = "staging_failed"
LEDGER_FAILED = "ledger_failed"
TOOL_PARSER_MISSING = "tool_parser_missing"  # raised by the gateway's reply reader (tasks.generate.agent_rollouts)
FAILURE_REASONS = (
    HISTORY_DIVERGED,
    PREFIX_MISMATCH,
    SPLICE_FAILED,
    TEMPLATE_ERROR,
    TOKENIZER_ERROR,
    TOOL_PARSER_MISSING,
    CONTEXT_LENGTH,
    ENGINE_ERROR,
    ENGINE_PROMPT_MISMATCH,
    INVALID_DELTA,
    STAGING_FAILED,
    LEDGER_FAILED,
)
_EMPTY = np.zeros(0, dtype=np.int64)
T = TypeVar("T")


@dataclass(frozen=True)
class ParentLink:
    """What a child call needs of its parent: the captured call it continues."""

    call_id: str
    cum_len: int
    chain_hash: str
    staging_chain: tuple[str, ...]  # staging keys root→this call
    conversation: tuple[CanonicalMessage, ...]  # the messages the call saw, plus its assistant reply
    prompt_length: int  # how many of those messages the call saw
    tools: str  # the tools it offered the model (tasks.capture.graph.tools_key)
    token_ids: np.ndarray  # the whole sequence through this call (kept in memory for uncaptured runs)


@dataclass
class RolloutCapture:
    """Capture state of one rollout across its calls."""

    batch_id: str
    rollout_id: str
    attempt: int
    seed: int
    message_graph: str | None = None  # the gateway's: splice or independent; None: the previous call is the parent
    next_ordinal: int = 0
    parent: ParentLink | None = None  # the latest call
    links: list[ParentLink] = field(default_factory=list)  # every call, when ``graph``
    records: list[CallRecord] = field(default_factory=list)
    failures: list[FailureRow] = field(default_factory=list)
    last_captured_call_id: str | None = None
    epoch_spans: int = 0
    generated_tokens: int = 0
    served_by: Counter[str] = field(default_factory=Counter)  # answers per server, where the engine names it
    failed_over: list[str] = field(default_factory=list)  # each restart after its server was lost: why

    @property
    def poisoned_reason(self) -> str | None:
        """The first failure's reason: any failure on the chain poisons the rollout."""
        return self.failures[0].reason if self.failures else None

    def restart(self, why: str) -> None:
        """Start the rollout again from its first turn: its calls so far stay in the ledger, off the new chain.

        Ordinals go on (no call id repeats), and records and failures are kept: the receipt counts
        every call the ledger holds of the rollout, and a failure before the restart still poisons it.
        """
        self.parent, self.links, self.last_captured_call_id = None, [], None
        self.failed_over.append(why)


ReplyReader = Callable[[str, str], tuple[Message, dict[str, Any]]]
"""(sampled text, call id) -> (the assistant message as the client gets it, what to note in the extras).

Runs where the prompts are rendered (the render thread); raises :class:`CallFault` to fail the call."""


@dataclass(frozen=True)
class CallShape:
    """How a gateway call differs from an environment's: what the template renders, tools, fewer tokens, the reply.

    ``rendered`` are the messages the chat template renders (tools offered in the system message,
    tool calls as text); ``tools`` go to a template that renders them itself; ``offered`` are the
    tools the model is offered either way (a call offering other tools than the call its history
    extends is a root, ``tools_changed``); ``max_tokens`` may only lower the plan's; ``read_reply``
    turns the sampled text into the assistant message the client gets (and a later request's
    history holds).
    """

    rendered: Sequence[Message] | None = None
    tools: Sequence[Mapping[str, Any]] = ()
    offered: Sequence[Mapping[str, Any]] = ()
    max_tokens: int | None = None
    read_reply: ReplyReader | None = None


@dataclass(frozen=True)
class CallOutcome:
    """A call's result: the completion and its assistant message (when one exists), a failure (when any)."""

    call_id: str
    completion: GenerationResult | None
    failure: FailureRow | None = None
    message: Message | None = None


@dataclass(frozen=True)
class _Admitted:
    """Stamped at admission: a call that spans a refit keeps this version (``epoch_span``).

    ``epoch_span`` is known at once when the engine reported its weight spans; otherwise it is
    whether the engine's version moved while the call ran.
    """

    weight_version: int
    at: float
    epoch_span: bool | None = None


class _CallFailed(Exception):
    def __init__(self, reason: str, detail: str, completion: GenerationResult | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.completion = completion


class CallCapture:
    """Prompt preparer and payload stager of one shard attempt, shared by all of its rollouts."""

    def __init__(
        self,
        *,
        engine: Engine,
        sampling: SamplingSettings,
        staging: StagingWriter | None,
        ledger: LedgerWriter | None,
        prefix_cache: ChainPrefixCache | None,
        capture: bool = True,
        render_executor: concurrent.futures.Executor | None = None,
    ) -> None:
        """``render_executor``: render and tokenize prompts there, off the loop (whose loop serves HTTP),
        with a copy of the engine's tokenizer that nothing else uses.

        One thread is enough and safest: a Hugging Face fast tokenizer must not encode in two
        threads at once, and the GIL would serialize the work anyway.
        """
        if capture and (staging is None or ledger is None or prefix_cache is None):
            raise ValueError("capture needs a staging writer, a ledger writer and a prefix cache")
        self.engine = engine
        self.sampling = sampling
        self.capture = capture
        self._render_executor = render_executor
        self._staging = staging
        self._ledger = ledger
        self._cache = prefix_cache
        # The tokenizer the capture renders with: used only where prompts are rendered (see the module doc),
        # from its first use on (the prompt builder is made there too).
        self.tokenizer = engine.tokenizer if render_executor is None else copy.deepcopy(engine.tokenizer)
        self._prompts: ChatPromptBuilder | None = None
        self._eos_token_id = engine.eos_token_id
        self._coordinates: dict[str, CommitCoordinates] = {}

    def coordinates_of(self, keys: Sequence[str]) -> list[tuple[str, CommitCoordinates]]:
        """(staging key, coordinates) of calls this attempt staged: the prefix cache's fetch input."""
        return [(key, self._coordinates[key]) for key in keys]

    def release(self, rollout: RolloutCapture) -> None:
        """Forget a finished rollout's coordinates and tokens: memory stays bounded by the rollouts in flight."""
        for record in rollout.records:
            self._coordinates.pop(ids.staging_key(record.rollout_id, record.call_id), None)
        rollout.parent = None
        rollout.links.clear()

    async def call(
        self, rollout: RolloutCapture, messages: Sequence[Message], shape: CallShape | None = None
    ) -> CallOutcome:
        """Run one model call of ``rollout`` on ``messages`` (the whole conversation so far)."""
        shape = shape or CallShape()
        call_id = ids.call_id(rollout.rollout_id, rollout.attempt, rollout.next_ordinal)
        seed = ids.derive_seed(rollout.seed, "call", rollout.next_ordinal)
        rollout.next_ordinal += 1
        captured = self.capture and rollout.poisoned_reason is None
        history = canonical_conversation(messages)
        tools = tools_key(shape.offered)
        notes: dict[str, Any] = {}
        parent = rollout.parent
        if rollout.message_graph == INDEPENDENT:
            parent = None
            if rollout.next_ordinal > 1:
                notes["root_reason"] = INDEPENDENT
        elif rollout.message_graph is not None:
            parent = find_parent(rollout.links, history, tools)
            reason = None if parent is not None else root_reason(rollout.links, history, tools)
            if reason is not None:
                notes["root_reason"] = reason
        try:
            parent_tokens = await self._parent_tokens(call_id, parent, history, captured)
            rendered = messages if shape.rendered is None else shape.rendered
            prompt = await self._rendering(self._prompt, call_id, rendered, parent_tokens, shape.tools)
            completion, admission = await self._generate(call_id, prompt, seed, rollout.rollout_id, shape.max_tokens)
            rollout.generated_tokens += len(completion.token_ids)
            if isinstance(server := completion.metadata.get(SERVED_BY), str):
                rollout.served_by[server] += 1
            message: Message = {"role": "assistant", "content": completion.text}
            if shape.read_reply is not None:
                try:
                    message, read_notes = await self._rendering(shape.read_reply, completion.text, call_id)
                except CallFault as fault:
                    raise _CallFailed(fault.reason, f"reply of {call_id}: {fault.detail}", completion) from None
                notes.update(read_notes)
            conversation = (*history, *canonical_conversation([message]))
            sequence = np.concatenate([prompt, np.asarray(completion.token_ids, np.int64)])
            if not captured:
                self._linked(rollout, _link(call_id, sequence, "0" * 64, (), conversation, len(history), tools))
                return CallOutcome(call_id, completion, message=message)
            extras = _with_notes(completion.extras, notes)
            record = await self._stage(rollout, call_id, parent, parent_tokens, prompt, completion, admission, extras)
        except _CallFailed as failed:
            failure = FailureRow(
                batch_id=rollout.batch_id,
                rollout_id=rollout.rollout_id,
                call_id=call_id,
                parent_call_id=parent.call_id if parent else None,
                reason=failed.reason,
                detail=failed.detail[:2000],
            )
            if captured:
                rollout.failures.append(failure)
                await asyncio.to_thread(self._ledger.add_failure, failure)  # type: ignore[union-attr]
            return CallOutcome(call_id, failed.completion, failure)
        rollout.records.append(record)
        rollout.last_captured_call_id = call_id
        rollout.epoch_spans += int(record.epoch_span)
        chain = (*(parent.staging_chain if parent else ()), ids.staging_key(rollout.rollout_id, call_id))
        self._cache.remember(chain[-1], sequence)  # type: ignore[union-attr]
        self._linked(rollout, _link(call_id, sequence, record.chain_hash, chain, conversation, len(history), tools))
        return CallOutcome(call_id, completion, message=message)

    async def _rendering(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` where the capture's tokenizer is used: the render thread, else here on the loop."""
        if self._render_executor is None:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._render_executor, work, *args)

    @staticmethod
    def _linked(rollout: RolloutCapture, link: ParentLink) -> None:
        rollout.parent = link
        if rollout.message_graph is not None:
            rollout.links.append(link)

    async def _parent_tokens(
        self, call_id: str, parent: ParentLink | None, messages: tuple[CanonicalMessage, ...], captured: bool
    ) -> np.ndarray:
        if parent is None:
            return _EMPTY
        seen = len(parent.conversation)
        if messages[:seen] != parent.conversation:
            raise _CallFailed(
                HISTORY_DIVERGED,
                f"the conversation of {call_id} does not extend its parent {parent.call_id}'s "
                f"{seen} messages: the environment rewrote earlier history",
            )
        if not captured:
            return parent.token_ids
        admission = Admission(
            call_id=call_id,
            parent_call_id=parent.call_id,
            prev_len=parent.cum_len,
            staging_chain=parent.staging_chain,
            parent_chain_hash=parent.chain_hash,
        )
        try:
            # The parent's tokens are normally in memory (written through when it was staged): a
            # lookup on the loop. Only a miss reads staging, in a thread. With an in-process engine
            # stepping on this loop (megatron), each trip through a thread costs the call an engine step.
            cached = resolve_cached_admission(admission, self._cache)  # type: ignore[arg-type]
            if cached is not None:
                return cached
            return await asyncio.to_thread(resolve_admission, admission, self._cache)  # type: ignore[arg-type]
        except PrefixMismatchError as exc:
            raise _CallFailed(PREFIX_MISMATCH, str(exc)) from None
        except StorageUnavailableError:
            raise
        except Exception as exc:
            raise _CallFailed(PREFIX_MISMATCH, f"parent tokens of {call_id} could not be resolved: {exc!r}") from None

    def _prompt(
        self,
        call_id: str,
        messages: Sequence[Message],
        parent_tokens: np.ndarray,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> np.ndarray:
        try:
            if self._prompts is None:
                self._prompts = ChatPromptBuilder(RenderTokenizer(self.tokenizer), eos_token_id=self._eos_token_id)
            prompt = self._prompts.prompt(messages, parent_tokens, tools=tools)
        except CallFault as fault:
            raise _CallFailed(fault.reason, f"prompt of {call_id}: {fault.detail}") from None
        except ValueError as exc:
            raise _CallFailed(SPLICE_FAILED, f"prompt of {call_id}: {exc}") from None
        if prompt.size < parent_tokens.size or not np.array_equal(prompt[: parent_tokens.size], parent_tokens):
            raise _CallFailed(PREFIX_MISMATCH, f"prompt of {call_id} does not start with its parent's exact tokens")
        if prompt.size >= self.engine.max_model_len:
            raise _CallFailed(
                CONTEXT_LENGTH,
                f"prompt of {call_id} has {prompt.size} tokens; the engine accepts {self.engine.max_model_len} in all",
            )
        return prompt

    async def _generate(
        self, call_id: str, prompt: np.ndarray, seed: int, session_id: str, max_tokens: int | None = None
    ) -> tuple[GenerationResult, _Admitted]:
        admitted = _Admitted(weight_version=self.engine.weight_version, at=time.time())
        prompt_ids = tuple(prompt.tolist())
        request = GenerationRequest(
            request_id=call_id,
            prompt_token_ids=prompt_ids,
            sampling=self.sampling,
            seed=seed,
            max_tokens=min(max_tokens or self.sampling.max_tokens, self.engine.max_model_len - prompt.size),
            session_id=session_id,
        )
        try:
            completion = await self.engine.generate(request)
            crash_point("engine_output", call_id)
        except EngineDeadError:
            raise
        except Exception as exc:
            raise _CallFailed(ENGINE_ERROR, f"engine failed {call_id}: {exc!r}") from None
        if tuple(completion.prompt_token_ids) != prompt_ids:
            raise _CallFailed(
                ENGINE_PROMPT_MISMATCH,
                f"the engine ran {call_id} on a prompt other than the one prepared "
                f"({len(completion.prompt_token_ids)} vs {len(prompt)} tokens)",
                completion,
            )
        if completion.weight_spans:
            versions = {span.version for span in completion.weight_spans}
            admitted = _Admitted(completion.weight_spans[0].version, admitted.at, epoch_span=len(versions) > 1)
        return completion, admitted

    async def _stage(
        self,
        rollout: RolloutCapture,
        call_id: str,
        parent: ParentLink | None,
        parent_tokens: np.ndarray,
        prompt: np.ndarray,
        completion: GenerationResult,
        admitted: _Admitted,
        extras: Any,
    ) -> CallRecord:
        try:
            delta = StagedDelta.build(
                batch_id=rollout.batch_id,
                rollout_id=rollout.rollout_id,
                call_id=call_id,
                parent_call_id=parent.call_id if parent else None,
                parent_chain_hash=parent.chain_hash if parent else None,
                prefix_token_ids=parent_tokens,
                prompt_token_ids=prompt,
                generated_token_ids=list(completion.token_ids),
                generated_logprobs=completion.logprobs,
                weight_version=admitted.weight_version,
                finish_reason=completion.finish_reason,
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                top_k=self.sampling.top_k,
                extras=extras,
                logprobs_mode=self.sampling.logprobs_mode,
            )
        except (TypeError, ValueError) as exc:
            raise _CallFailed(INVALID_DELTA, f"delta of {call_id} is invalid: {exc}", completion) from None
        fingerprint = fingerprint_content(completion.text)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[CallRecord | Exception] = loop.create_future()

        def settle(result: CallRecord | Exception) -> None:
            if not done.done():
                done.set_result(result)

        def record_when_staged(staged: concurrent.futures.Future[CommitCoordinates]) -> None:
            # Runs where the staging future resolves (the writer thread, after the group commit):
            # the ledger gets the record there, and the call comes back to the loop once, not twice.
            try:
                coordinates = staged.result()
            except StorageUnavailableError as exc:
                result: CallRecord | Exception = exc
            except BaseException as exc:
                result = _CallFailed(STAGING_FAILED, f"staging {call_id} failed: {exc!r}", completion)
            else:
                self._coordinates[delta.staging_key] = coordinates
                try:
                    record = CallRecord.for_staged(
                        delta,
                        staging_segment=coordinates.segment,
                        staging_row=coordinates.row,
                        admitted_at=admitted.at,
                        epoch_span=(
                            admitted.epoch_span
                            if admitted.epoch_span is not None
                            else self.engine.weight_version != admitted.weight_version
                        ),
                        output_fingerprint=fingerprint,
                        response_id=completion.response_id,
                    )
                    self._ledger.add_call(record)  # type: ignore[union-attr]
                    result = record
                except StorageUnavailableError as exc:
                    result = exc
                except Exception as exc:
                    result = _CallFailed(LEDGER_FAILED, f"ledger record of {call_id} failed: {exc!r}", completion)
            loop.call_soon_threadsafe(settle, result)

        try:
            staged = self._staging.submit(delta)  # type: ignore[union-attr]
        except Exception as exc:
            raise _CallFailed(STAGING_FAILED, f"staging {call_id} failed: {exc!r}", completion) from None
        staged.add_done_callback(record_when_staged)
        result = await done
        if isinstance(result, Exception):
            raise result
        record = result
        return record


def _with_notes(engine_extras: Any, notes: Mapping[str, Any]) -> Any:
    """The staged extras: the engine's alone, or with the gateway's notes (``{"gateway": ..., "engine": ...}``)."""
    if not notes:
        return engine_extras
    extras: dict[str, Any] = {"gateway": dict(notes)}
    if engine_extras is not None:
        extras["engine"] = engine_extras
    return extras


def _link(
    call_id: str,
    sequence: np.ndarray,
    chain_hash: str,
    chain: tuple[str, ...],
    conversation: tuple[CanonicalMessage, ...],
    prompt_length: int,
    tools: str,
) -> ParentLink:
    sequence.setflags(write=False)
    return ParentLink(
        call_id=call_id,
        cum_len=int(sequence.size),
        chain_hash=chain_hash,
        staging_chain=chain,
        conversation=conversation,
        prompt_length=prompt_length,
        tools=tools,
        token_ids=sequence,
    )
