"""Agent rollouts: each agent calls the model through its own route on the attempt's capture gateway.

:class:`GatewayCalls` is what stands behind the routes: a checked request becomes one captured
call (:meth:`tasks.capture.calls.CallCapture.call` with the rollout's message graph) in the
request's :class:`~tasks.gateway.shape.CallShape`, whose sampled text is read back into content and
tool calls (:class:`~tasks.gateway.reply.ReplyReader`). Tools are rendered by the chat template
when it renders them, else offered in the fallback format (:mod:`tasks.gateway.tools`).

A call that fails is answered with an error whose ``code`` is its failure reason (the rollout
is poisoned by its failure row already): 400 when the request is what the model or its template
refuses (``context_length_exceeded``, ``template_error``) and for the capture's own named
failures as before, 500 ``server_error`` for the gateway's own tokenizer or tool parser
(:data:`SERVER_FAULTS`; the ``openai`` client retries a 500, and a retry of a failed call is a
call of a poisoned rollout: it records nothing). The engine dying, storage staying unavailable,
or any other error of the capture path (a bug: no named failure) is the attempt's failure, not
the rollout's: the request gets a 503, and :func:`run_agent_rollout` cancels its agent and raises
the error, which ends the attempt (the retry resumes the rollout).

Reading replies runs where the capture renders (its render thread, with its own tokenizer).
:func:`run_agent_rollout` makes the receipt only once every call started on the rollout's route
has finished (:meth:`~tasks.gateway.app.RolloutRoute.settled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from tasks.capture.calls import CallCapture
from tasks.capture.faults import CONTEXT_LENGTH, TOKENIZER_ERROR, TOOL_PARSER_MISSING, CallFault
from tasks.capture.rollout import RolloutCapture
from tasks.capture.terminal import fingerprint_content
from tasks.config import BatchConfig
from tasks.environments.agents import AGENT_ERROR, MAX_SHOWN_OUTPUT, Agent, AgentDoor, AgentFailure, AgentResult
from tasks.environments.base import Message, Turn
from tasks.errors import EngineDeadError, StorageUnavailableError
from tasks.gateway.app import Answer, Reply, RolloutRoute, Rollouts
from tasks.gateway.protocol import ChatRequest, GatewayError, invalid
from tasks.gateway.reply import ReplyReader, ToolParserMissing
from tasks.gateway.shape import call_shape, renders_tools
from tasks.generate.progress import Progress
from tasks.generate.receipts import Witnesses, receipt_of
from tasks.records.ledger import FailureRow, Receipt
from tasks.records.planned import PlannedRollout

log = logging.getLogger(__name__)
SERVER_FAULTS = frozenset({TOKENIZER_ERROR, TOOL_PARSER_MISSING})  # failures answered 500: the gateway's own


class GatewayCalls:
    """The capture path behind one attempt's gateway; ``fatal`` resolves to the error that ends the attempt."""

    def __init__(self, capture: CallCapture, progress: Progress) -> None:
        self.capture = capture
        self.progress = progress
        self.fatal: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.template_renders_tools = renders_tools(capture.tokenizer)
        self._replies = ReplyReader(capture.tokenizer)  # used where the capture renders

    def answer(self, state: RolloutCapture) -> Answer:
        """What one rollout's route answers with."""

        async def answer(chat: ChatRequest) -> Reply:
            shape = call_shape(chat, template_renders_tools=self.template_renders_tools, read_reply=self._read_reply)
            try:
                outcome = await self.capture.call(state, chat.messages, shape)
            except Exception as error:  # the engine died, storage is unavailable, or a bug: the attempt ends
                if not isinstance(error, EngineDeadError | StorageUnavailableError):
                    log.exception("rollout %s: the capture path failed", state.rollout_id)
                if not self.fatal.done():
                    self.fatal.set_result(error)
                ended = GatewayError(503, f"the attempt ended: {error}", kind="server_error", code="attempt_ended")
                raise ended from None
            completion, failure = outcome.completion, outcome.failure
            sampled = 0 if completion is None or outcome.replayed else len(completion.token_ids)
            self.progress.call_done(sampled, failure is not None)
            if failure is not None:
                raise _failed(failure)
            assert completion is not None and outcome.message is not None  # a call that did not fail has both
            tool_calls = list(outcome.message.get("tool_calls") or [])
            finish = "tool_calls" if tool_calls else "length" if completion.finish_reason == "length" else "stop"
            return Reply(
                call_id=outcome.call_id,
                content=outcome.message.get("content"),
                tool_calls=tool_calls,
                finish_reason=finish,
                prompt_tokens=len(completion.prompt_token_ids),
                completion_tokens=len(completion.token_ids),
            )

        return answer

    def _read_reply(self, text: str, call_id: str) -> tuple[Message, dict[str, Any]]:
        """The reply read back (runs where the capture renders); a missing tool parser fails the call."""
        try:
            return self._replies(text, call_id)
        except ToolParserMissing as missing:
            raise CallFault(TOOL_PARSER_MISSING, str(missing)) from None


def _failed(failure: FailureRow) -> GatewayError:
    """The answer to a call that failed with ``failure``: its reason is the error's code."""
    message = f"the call failed ({failure.reason}): {failure.detail}"
    if failure.reason in SERVER_FAULTS:
        return GatewayError(500, message, kind="server_error", code=failure.reason)
    code = "context_length_exceeded" if failure.reason == CONTEXT_LENGTH else failure.reason
    return invalid(message, param="messages", code=code)


async def run_agent_rollout(
    planned: PlannedRollout,
    config: BatchConfig,
    state: RolloutCapture,
    agent: Agent,
    calls: GatewayCalls,
    gateway: Rollouts,
    base_url: str,
) -> Receipt:
    """One episode of ``agent`` on its own gateway route, captured in ``state``; the receipt.

    The receipt is made once the episode has ended and every call started on its route has finished,
    so it counts every call the ledger holds of the rollout and none is written after it. Raises the
    attempt's fatal error (the engine died, storage is unavailable) instead of a receipt; the calls
    still running are then cancelled.
    """
    answer = calls.answer(state)
    route = gateway.open(planned.rollout_id, sampling=config.sampling, max_calls=config.max_turns, answer=answer)
    door = AgentDoor(base_url=f"{base_url}/rollouts/{planned.rollout_id}/v1", api_key=route.key)
    episode = asyncio.ensure_future(agent.run(door, json.loads(planned.task_json)))
    settled: asyncio.Future[None] | None = None
    try:
        await asyncio.wait({episode, calls.fatal}, return_when=asyncio.FIRST_COMPLETED)
        gateway.end(planned.rollout_id)
        settled = asyncio.ensure_future(route.settled())
        await asyncio.wait({settled, calls.fatal}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gateway.end(planned.rollout_id)
        if not episode.done():
            episode.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await episode
        if settled is not None:
            settled.cancel()
        route.cancel_calls()  # none are left once settled; else the attempt is ending
    if calls.fatal.done():
        raise calls.fatal.result()
    result: AgentResult | None = None
    failure: AgentFailure | None = None
    try:
        result = episode.result()
    except AgentFailure as error:
        failure = error
    except Exception as error:  # an agent class's own bug fails its rollout, never the attempt
        failure = AgentFailure(AGENT_ERROR, f"{type(error).__name__}: {error}"[:MAX_SHOWN_OUTPUT])
    if failure is not None:
        log.warning("rollout %s: %s: %s", planned.rollout_id, failure.reason, failure.detail)
    return receipt_of(
        planned,
        state,
        None if result is None else Turn.finish(result.reward, **result.info),
        None if failure is None else f"{failure.reason}: {failure.detail}",
        error_reason=failure.reason if failure is not None else AGENT_ERROR,
        witnesses=_witnesses(state, result, route.final_response_id),
        poisoning_wins=True,
        notes=refusal_notes(route),
    )


def refusal_notes(route: RolloutRoute) -> dict[str, Any] | None:
    """What the receipt's reward info says of the requests refused on ``route``: the ones the gateway kept
    (``refused_requests``) and, when it kept no more, how many it only counted (``refused_requests_dropped``)."""
    notes: dict[str, Any] = {}
    if route.refusals:
        notes["refused_requests"] = [f"{r.status} {r.code}: {r.message}" for r in route.refusals]
    if route.refusals_dropped:
        notes["refused_requests_dropped"] = route.refusals_dropped
    return notes or None


def _witnesses(state: RolloutCapture, result: AgentResult | None, header: str | None) -> Witnesses:
    """The scored call: the response the agent named (in its result, the gateway's final-response
    header, or both: they must agree), else its last call; its final output's text must agree.

    The final output is a witness only where its text is one call's alone (abstains otherwise);
    naming another call than the declared one is ``witness_disagreement``.
    """
    named = (result.response_id if result is not None else None, header)
    declared = tuple(response_id.removeprefix("chatcmpl-") for response_id in named if response_id is not None)
    if not declared and state.last_captured_call_id is not None:
        declared = (state.last_captured_call_id,)
    final_output = result.final_output if result is not None else None
    fingerprint = fingerprint_content(final_output) if final_output is not None else None
    return Witnesses(declared_call_ids=declared, content_fingerprint=fingerprint)
