"""Engine-agnostic call capture: one model call, captured (docs/architecture.md §5).

:meth:`CallCapture.call` runs the steps of one call in order, each a function of the rollout's
state (:class:`~tasks.capture.rollout.RolloutCapture`): admission (:mod:`~tasks.capture.admission`:
call id, seed, parent), the prompt (:mod:`~tasks.capture.prompt`: parent tokens, render, splice),
the engine call (:mod:`~tasks.capture.engine_call`), the reply read back (a caller's
``read_reply``, on the render thread), and the recording (:mod:`~tasks.capture.recording`: staged
delta, then call record). A child is admitted only after its parent's record was handed to the
ledger, which writes a rollout's receipt only after all of its records are durable.

A resumed episode (:mod:`tasks.capture.replay`) answers a call from its replay book when it matches
the book's next entry: after the prompt is made and before any engine call, the entry's answer is
read back as the original was, and nothing is staged or recorded again; its live calls note the
episode in their extras.

Every failure writes a failure row with a named reason (:data:`~tasks.capture.faults.FAILURE_REASONS`:
each step raises :class:`~tasks.capture.faults.CallFault`) and poisons the rollout; the caller still
gets the completion when one exists (a capture failure is not a generation failure), and later calls
of a poisoned rollout run uncaptured. The engine dying (:class:`EngineDeadError`) and storage staying
unavailable through every retry (:class:`StorageUnavailableError`) are no failures of the call: they
propagate and end the shard attempt, and the retry resumes the rollout. With ``capture=False`` the
same path runs minus staging and ledger (the overhead benchmark).

A rollout's calls form a chain by default: each call must extend the previous one's conversation
(else ``history_diverged``). Under a message graph (the gateway's agents) a call's parent is the
earlier call its history extends, and a call that extends none is a new root whose reason is staged
in its extras (``{"gateway": {"root_reason": ...}}``, :func:`~tasks.capture.recording.staged_extras`).
What a gateway call asks beyond its messages comes as :class:`CallOptions`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tasks.capture.admission import Admitted, admit, check_history
from tasks.capture.engine_call import generate, token_budget
from tasks.capture.faults import CallFault
from tasks.capture.graph import canonical_conversation
from tasks.capture.prefix_cache import ChainPrefixCache
from tasks.capture.prompt import Prompts
from tasks.capture.recording import CallRecorder, failure_row, staged_extras
from tasks.capture.replay import BookEntry
from tasks.capture.rollout import ParentLink, RolloutCapture
from tasks.engines.base import Engine, GenerationResult
from tasks.environments.base import Message
from tasks.records.ledger import FailureRow
from tasks.sampling import SamplingSettings
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.staging import CommitCoordinates, StagingWriter

UNCAPTURED_CHAIN_HASH = "0" * 64  # the chain hash an uncaptured call links with


class CallOptions(Protocol):
    """What a call may ask beyond its messages (the gateway's :class:`tasks.gateway.shape.CallShape`).

    ``rendered``: the messages the chat template renders instead (None: the messages); ``tools``:
    tools for a template that renders them; ``offered``: the tools the model is offered either way
    (the message graph's tools); ``max_tokens``: may only lower the plan's; ``read_reply``:
    (sampled text, call id) → (the assistant message, notes staged in the extras), run where prompts
    are rendered, raising :class:`CallFault` to fail the call.
    """

    @property
    def rendered(self) -> Sequence[Message] | None: ...

    @property
    def tools(self) -> Sequence[Mapping[str, Any]]: ...

    @property
    def offered(self) -> Sequence[Mapping[str, Any]]: ...

    @property
    def max_tokens(self) -> int | None: ...

    @property
    def read_reply(self) -> Callable[[str, str], tuple[Message, dict[str, Any]]] | None: ...


@dataclass(frozen=True)
class CallOutcome:
    """A call's result: the completion and its assistant message (when one exists), a failure (when any);
    ``replayed``: answered from the replay book, not sampled now."""

    call_id: str
    completion: GenerationResult | None
    failure: FailureRow | None = None
    message: Message | None = None
    replayed: bool = False


class CallCapture:
    """The coordinator of one shard attempt's calls, shared by all of its rollouts."""

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
        self._prompts = Prompts(engine, prefix_cache, render_executor)
        # Only captured calls are recorded, and capture checked its writers above.
        self._recorder = CallRecorder(engine, sampling, staging, ledger) if capture else None  # type: ignore[arg-type]

    @property
    def tokenizer(self) -> Any:
        """The tokenizer the capture renders with: use it only where prompts are rendered."""
        return self._prompts.tokenizer

    def decode(self, token_ids: Sequence[int]) -> str:
        """Sampled ids as the engine reports their text, with the capture's tokenizer (where prompts are rendered,
        or before any call runs)."""
        return self.engine.decode(token_ids, self._prompts.tokenizer)

    def coordinates_of(self, keys: Sequence[str]) -> list[tuple[str, CommitCoordinates]]:
        """(staging key, coordinates) of calls this attempt staged: the prefix cache's fetch input."""
        if self._recorder is None:
            raise KeyError(f"an uncaptured attempt stages nothing: {list(keys)}")
        return self._recorder.coordinates_of(keys)

    def release(self, rollout: RolloutCapture) -> None:
        """Forget a finished rollout's coordinates and tokens: memory stays bounded by the rollouts in flight."""
        if self._recorder is not None:
            self._recorder.forget(rollout.records)
        rollout.release()

    async def call(
        self, rollout: RolloutCapture, messages: Sequence[Message], options: CallOptions | None = None
    ) -> CallOutcome:
        """Run one model call of ``rollout`` on ``messages`` (the whole conversation so far)."""
        call = admit(rollout, messages, options.offered if options else (), capture=self.capture)
        read_reply = options.read_reply if options else None
        try:
            check_history(call)
            parent_tokens = await self._prompts.parent_tokens(call)
            rendered = messages if options is None or options.rendered is None else options.rendered
            prompt = await self._prompts.prompt(call.call_id, rendered, parent_tokens, options.tools if options else ())
            budget = token_budget(self.engine, self.sampling, prompt, options.max_tokens if options else None)
            seed = rollout.seed_for(prompt)
            if rollout.book is not None and call.captured:
                replayed = await self._replay(rollout, call, parent_tokens.size, prompt, budget, read_reply)
                if replayed is not None:
                    return replayed
            completion, version = await generate(
                self.engine, self.sampling, call.call_id, prompt, seed, rollout.rollout_id, budget
            )
            rollout.generated(completion)
            message, notes = await self._reply(call, completion, read_reply)
            conversation = (*call.history, *canonical_conversation([message]))
            sequence = np.concatenate([prompt, np.asarray(completion.token_ids, np.int64)])
            if not call.captured:
                rollout.linked(_link(call, sequence, UNCAPTURED_CHAIN_HASH, (), conversation))
                return CallOutcome(call.call_id, completion, message=message)
            diverged = rollout.book is not None and rollout.book.diverges(call.parent_call_id)
            resume = rollout.book.notes(diverged=diverged) if rollout.book is not None else {}
            extras = staged_extras(completion.extras, {**call.notes, **notes}, resume, completion.kept)
            record = await self._recorder.record(  # type: ignore[union-attr]  # a captured call has one
                rollout, call, parent_tokens, prompt, completion, version, extras
            )
        except CallFault as fault:
            failure = failure_row(rollout, call, fault)
            if call.captured:
                rollout.failed(failure)
                await self._recorder.add_failure(failure)  # type: ignore[union-attr]
            return CallOutcome(call.call_id, fault.completion, failure)
        chain = call.staging_chain(rollout.rollout_id)
        self._prompts.remember(chain[-1], sequence)
        entry = BookEntry(
            record=record,
            prompt_tokens=prompt[parent_tokens.size :],
            token_ids=completion.token_ids,
            logprobs=completion.logprobs,
            text=completion.text,
            finish_reason=completion.finish_reason,
            carried=False,
        )
        link = _link(call, sequence, record.chain_hash, chain, conversation)
        rollout.recorded(entry, link, diverged=diverged)
        return CallOutcome(call.call_id, completion, message=message)

    async def _replay(
        self,
        rollout: RolloutCapture,
        call: Admitted,
        parent_length: int,
        prompt: np.ndarray,
        budget: int,
        read_reply: Callable[[str, str], tuple[Message, dict[str, Any]]] | None,
    ) -> CallOutcome | None:
        """``call`` answered from its book's entry as the original attempt answered it; None when no entry answers
        it, or the entry's reply is not read back as it was then (the call goes live)."""

        async def read_back(entry: BookEntry) -> Message | None:
            try:
                message, _ = await self._reply(as_entry(entry), entry.answer(prompt), read_reply)
            except CallFault:
                return None
            return message

        def as_entry(entry: BookEntry) -> Admitted:
            return dataclasses.replace(call, call_id=entry.record.call_id)

        book = rollout.book
        assert book is not None  # the caller replays only with one
        answered = await book.answer(call.parent_call_id, parent_length, prompt, budget, read_back)
        if answered is None:
            return None
        entry, message = answered
        answer = entry.answer(prompt)
        conversation = (*call.history, *canonical_conversation([message]))
        sequence = np.concatenate([prompt, np.asarray(answer.token_ids, np.int64)])
        chain = as_entry(entry).staging_chain(rollout.rollout_id)
        self._prompts.remember(chain[-1], sequence)
        if entry.carried:
            self._recorder.carry(entry.record)  # type: ignore[union-attr]  # a replayed call is captured
        link = _link(as_entry(entry), sequence, entry.record.chain_hash, chain, conversation)
        rollout.replayed(entry, link)
        return CallOutcome(entry.record.call_id, answer, message=message, replayed=True)

    async def _reply(
        self,
        call: Admitted,
        completion: GenerationResult,
        read_reply: Callable[[str, str], tuple[Message, dict[str, Any]]] | None,
    ) -> tuple[Message, dict[str, Any]]:
        """The assistant message of ``completion`` and the reader's notes (none without a reader)."""
        if read_reply is None:
            return {"role": "assistant", "content": completion.text}, {}
        try:
            return await self._prompts.rendering(read_reply, completion.text, call.call_id)
        except CallFault as fault:
            raise CallFault(fault.reason, f"reply of {call.call_id}: {fault.detail}", completion) from None


def _link(
    call: Admitted,
    sequence: np.ndarray,
    chain_hash: str,
    chain: tuple[str, ...],
    conversation: tuple[Any, ...],
) -> ParentLink:
    return ParentLink.of(call.call_id, sequence, chain_hash, chain, conversation, len(call.history), call.tools)
