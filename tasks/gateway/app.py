"""The capture gateway's HTTP face: OpenAI-style chat completions, one route per rollout.

``POST /rollouts/{rollout_id}/v1/chat/completions`` and ``GET /rollouts/{rollout_id}/v1/models``
answer the clients of the rollouts registered in a :class:`Rollouts`. Each rollout has its own
random bearer key. A request without it, with another rollout's key, or for a rollout id that
does not exist gets the same 401 ``invalid_api_key`` (:data:`UNAUTHORIZED`: nothing in it tells a
prober which ids are live); it is counted on the gateway (:attr:`Rollouts.auth_failures`), never
kept on a rollout, since whoever sent it may not be that rollout's agent.

A request with the rollout's key that the gateway refuses (the rollout ended, beyond its call
limit, over the :class:`~tasks.gateway.limits.GatewayLimits`, outside the plan) gets the status
and OpenAI error body a client expects, never one the ``openai`` client retries (400, 413), but
one: a chat completion beyond the rollout's ``max_concurrent_requests`` gets 429
``too_many_concurrent_requests`` with ``Retry-After``, which the client retries by default. That
is deliberate: the refusal is transient (a call in flight ends soon), and the refused request
never reached the capture path, so a retry records nothing twice. The first
:data:`MAX_RECORDED_REFUSALS` refusals are kept on the rollout, the rest only counted.

A checked request starts a call: the rollout's :data:`Answer` (the capture path) runs as a task
of the route, not of the request, so a client that goes away never cuts a call short. Its
:class:`Reply` becomes a ``chat.completion`` or, with ``stream``, server-sent
``chat.completion.chunk`` events, built as the ``openai`` package's own models (``openai.types.chat``;
imported where an answer is built: the package takes half a second to import) and written with
the fields set, as the API writes them. A request may also name the rollout's scored response in
:data:`FINAL_RESPONSE_HEADER`.

Two rules keep a rollout's calls exactly those its receipt counts:

* **No call outlives its rollout.** :meth:`Rollouts.end` refuses every later request
  (``rollout_ended``; checked again once the body is read, and a call starts in the same step as
  that check, so none starts after the end); :meth:`RolloutRoute.settled` returns once every call
  started on the route has finished, answered or failed. The receipt is made after that.
* **A retry is the call it repeats.** A chat completion whose body is, byte for byte, that of the
  route's latest call with that body, while every client that asked for that call went away
  before its answer was sent (a client timeout, a dropped connection), is answered from that
  call: it waits for it if it is still running and gets its reply (same id) or its error. It
  starts no call and counts for no turn. A request repeated after its answer was sent to its
  client, or while a client still waits for it, is a new call (an agent asking again on purpose).
  A connection whose close the server has not yet seen when the answer is ready counts as one
  the answer was sent to.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tasks.gateway.body import parse_json, read_body
from tasks.gateway.limits import DEFAULT_LIMITS, GatewayLimits
from tasks.gateway.protocol import ChatRequest, GatewayError, invalid, read_chat_request
from tasks.sampling import SamplingSettings

if TYPE_CHECKING:
    from openai.types import CompletionUsage
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

ROLLOUT_PATH = "/rollouts/{rollout_id}/v1"
# A client that cannot return a response id with its result names its scored response here, on
# any request of the rollout (a later request's value replaces an earlier one's).
FINAL_RESPONSE_HEADER = "X-Final-Response-Id"
MAX_RESPONSE_ID_CHARS = 256
MAX_RECORDED_REFUSALS = 32  # per rollout, kept for its receipt; later ones are only counted
RETRY_AFTER_SECONDS = 1  # told to a client refused for too many concurrent requests
CLIENT_GONE = 499  # the status of an answer nobody reads (its client went away): never sent


@dataclass(frozen=True)
class Reply:
    """One answered call: the assistant message's text and tool calls, why sampling stopped, and the token counts."""

    call_id: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str  # "stop", "length" or "tool_calls"
    prompt_tokens: int
    completion_tokens: int


Answer = Callable[[ChatRequest], Awaitable[Reply]]


@dataclass
class Refusal:
    """A request the gateway refused for a rollout: the status, the error code and the message the client got."""

    status: int
    code: str | None
    message: str


@dataclass
class RouteCall:
    """A call a route started: its answer (a task of the route), how many clients wait for it, and whether
    one got it (a client that asked for it was still connected when its answer was sent)."""

    task: asyncio.Task[Reply]
    waiting: int = 0
    delivered: bool = False


@dataclass
class RolloutRoute:
    """One rollout's door: its key, the plan's sampling, its call limit, its answer, its calls, and what it refused.

    ``calls`` counts the calls started (a retry answered from a call starts none); ``refusals``
    holds at most :data:`MAX_RECORDED_REFUSALS`, ``refusals_dropped`` counts the rest.
    """

    rollout_id: str
    key: str
    sampling: SamplingSettings
    max_calls: int
    answer: Answer
    calls: int = 0
    in_flight: int = 0
    ended: bool = False
    final_response_id: str | None = None
    refusals: list[Refusal] = field(default_factory=list)
    refusals_dropped: int = 0
    _latest: dict[str, RouteCall] = field(default_factory=dict)  # body digest -> the latest call with that body
    _running: set[asyncio.Task[Reply]] = field(default_factory=set)

    def start(self, chat: ChatRequest, digest: str) -> RouteCall:
        """A new call answering ``chat`` (whose body has ``digest``), running as a task of the route.

        Only on a route not ended: the caller checks :attr:`ended` with no await before this.
        """
        self.calls += 1
        task = asyncio.get_running_loop().create_task(self.answer(chat), name=f"{self.rollout_id}-call-{self.calls}")
        self._running.add(task)
        task.add_done_callback(self._finished)
        call = self._latest[digest] = RouteCall(task)
        return call

    def retried(self, digest: str) -> RouteCall | None:
        """The call a request whose body has ``digest`` retries, if any: the latest call with that body, when
        every client that asked for it went away before its answer was sent."""
        call = self._latest.get(digest)
        return call if call is not None and not call.waiting and not call.delivered else None

    async def settled(self) -> None:
        """Return once every call started on the route has finished (answered or failed); then forget them.

        Call after :meth:`Rollouts.end`: no call starts on an ended route, so none is running after this.
        """
        if self._running:
            await asyncio.wait(set(self._running))
        self._latest.clear()

    def cancel_calls(self) -> None:
        """Cancel the calls still running (the attempt is ending: nothing of them is kept)."""
        for task in self._running:
            task.cancel()

    def _finished(self, task: asyncio.Task[Reply]) -> None:
        self._running.discard(task)
        if not task.cancelled():
            task.exception()  # a failed call's error is its clients' answer; read here too, for calls nobody awaits

    def refuse(self, error: GatewayError) -> GatewayError:
        """``error``, kept among the rollout's refusals while there are fewer than :data:`MAX_RECORDED_REFUSALS`."""
        if len(self.refusals) < MAX_RECORDED_REFUSALS:
            self.refusals.append(Refusal(error.status, error.code, error.message))
        else:
            self.refusals_dropped += 1
        return error


def unauthorized() -> GatewayError:
    """The one answer to a request without its route's key, whatever the route: an unknown id answers the same."""
    return GatewayError(401, "invalid API key for this route", kind="invalid_request_error", code="invalid_api_key")


class Rollouts:
    """The rollouts a gateway serves, each under its own random bearer key.

    ``auth_failures`` counts the requests refused for want of their route's key (unknown ids included);
    ``created`` (Unix seconds) is when the gateway began serving ``model``, as ``/models`` lists it.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.created = int(time.time())
        self.auth_failures = 0
        self._routes: dict[str, RolloutRoute] = {}
        self._decoy_key = secrets.token_urlsafe(32)  # compared for an unknown id, as a route's key would be

    def open(self, rollout_id: str, *, sampling: SamplingSettings, max_calls: int, answer: Answer) -> RolloutRoute:
        """Register ``rollout_id``; the route holds the key its client must send."""
        if rollout_id in self._routes:
            raise ValueError(f"rollout {rollout_id!r} is already open on this gateway")
        route = RolloutRoute(rollout_id, secrets.token_urlsafe(32), sampling, max_calls, answer)
        self._routes[rollout_id] = route
        return route

    def end(self, rollout_id: str) -> RolloutRoute:
        """Refuse every later request of ``rollout_id`` (``rollout_ended``); its route stays for the record.

        Calls already started run on: await the route's :meth:`~RolloutRoute.settled` before its receipt.
        """
        route = self._routes[rollout_id]
        route.ended = True
        return route

    def route(self, rollout_id: str, authorization: str | None) -> RolloutRoute:
        """The open route ``rollout_id`` if ``authorization`` carries its key; else GatewayError.

        Without the key (or for an unknown id) :func:`unauthorized`, counted in ``auth_failures``;
        for an ended rollout ``rollout_ended``, kept on the route.
        """
        route = self._routes.get(rollout_id)
        key = (authorization or "").removeprefix("Bearer ").strip()
        expected = route.key if route is not None else self._decoy_key
        if not hmac.compare_digest(key.encode(), expected.encode()) or route is None:
            self.auth_failures += 1
            raise unauthorized()
        if route.ended:
            raise route.refuse(_ended(route))
        return route


def _ended(route: RolloutRoute) -> GatewayError:
    return invalid(f"rollout {route.rollout_id!r} has ended", code="rollout_ended")


def _declare_final_response(route: RolloutRoute, request: Request) -> None:
    """Keep the response id ``request``'s :data:`FINAL_RESPONSE_HEADER` names, if it has one."""
    value = request.headers.get(FINAL_RESPONSE_HEADER)
    if value is None:
        return
    value = value.strip()
    if not value or len(value) > MAX_RESPONSE_ID_CHARS:
        shown = value[:40] + ("..." if len(value) > 40 else "")
        raise route.refuse(
            invalid(
                f"{FINAL_RESPONSE_HEADER} must name a response id of 1 to {MAX_RESPONSE_ID_CHARS} characters, "
                f"got {shown!r}",
                code="invalid_final_response_id",
            )
        )
    route.final_response_id = value


def _busy(route: RolloutRoute, limits: GatewayLimits) -> GatewayError:
    return GatewayError(
        429,
        f"rollout {route.rollout_id!r} has {route.in_flight} requests in flight, the gateway's "
        f"max_concurrent_requests {limits.max_concurrent_requests}: retry when one has been answered",
        kind="rate_limit_error",
        code="too_many_concurrent_requests",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def create_app(rollouts: Rollouts, limits: GatewayLimits = DEFAULT_LIMITS) -> FastAPI:
    """The FastAPI application serving ``rollouts``, each request under ``limits``."""
    app = FastAPI(title="rollout-ledger capture gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(GatewayError)
    async def refused(_: Request, error: GatewayError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.get(ROLLOUT_PATH + "/models")
    async def models(rollout_id: str, request: Request) -> dict[str, Any]:
        from openai.types import Model

        _declare_final_response(rollouts.route(rollout_id, request.headers.get("authorization")), request)
        served = Model(id=rollouts.model, object="model", created=rollouts.created, owned_by="rollout-ledger")
        return {"object": "list", "data": [served.to_dict(mode="json")]}

    @app.post(ROLLOUT_PATH + "/chat/completions", response_model=None)
    async def chat_completions(rollout_id: str, request: Request) -> Response:
        route = rollouts.route(rollout_id, request.headers.get("authorization"))
        if route.in_flight >= limits.max_concurrent_requests:
            raise route.refuse(_busy(route, limits))
        route.in_flight += 1
        try:
            return await complete(route, request)
        finally:
            route.in_flight -= 1

    async def complete(route: RolloutRoute, request: Request) -> Response:
        """Read, check and answer one chat completion of ``route``; a refusal is kept on the route."""
        _declare_final_response(route, request)
        try:
            body = await read_body(request, limits)
            try:
                parsed = await parse_json(body)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
                raise invalid("the request body is not JSON", code="invalid_json") from None
            chat = read_chat_request(parsed, route.sampling, limits)
            if route.ended:  # the episode ended while the body was read
                raise _ended(route)
            digest = hashlib.sha256(body).hexdigest()
            call = route.retried(digest)
            if call is None:
                if route.calls >= route.max_calls:
                    raise invalid(
                        f"rollout {route.rollout_id!r} made its {route.max_calls} calls (the plan's max_turns)",
                        code="max_turns_exceeded",
                    )
                call = route.start(chat, digest)
        except GatewayError as error:
            raise route.refuse(error) from None
        reply = await _answer_of(call, request)
        if reply is None:
            return Response(status_code=CLIENT_GONE)
        created = int(time.time())
        if chat.stream:
            events = _chunks(reply, rollouts.model, created, include_usage=chat.include_usage)
            return StreamingResponse(_sse(events), media_type="text/event-stream")
        return JSONResponse(_completion(reply, rollouts.model, created).to_dict(mode="json"))

    return app


async def _answer_of(call: RouteCall, request: Request) -> Reply | None:
    """``call``'s reply for ``request``'s client (raises the call's GatewayError), or None when the client went
    away first; the call runs on either way."""
    call.waiting += 1
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({call.task, gone}, return_when=asyncio.FIRST_COMPLETED)
        answered = call.task.done() and not gone.done()
    finally:
        call.waiting -= 1
        gone.cancel()
    if not answered:
        return None
    call.delivered = True
    if call.task.cancelled():
        raise GatewayError(503, "the attempt ended", kind="server_error", code="attempt_ended")
    return call.task.result()


async def _client_gone(request: Request) -> None:
    """Return when ``request``'s client has gone (its body was read: the server has nothing else to tell)."""
    while (await request.receive())["type"] != "http.disconnect":
        continue


def _completion_id(reply: Reply) -> str:
    return f"chatcmpl-{reply.call_id}"


def _usage(reply: Reply) -> CompletionUsage:
    from openai.types import CompletionUsage

    total = reply.prompt_tokens + reply.completion_tokens
    return CompletionUsage(
        prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens, total_tokens=total
    )


def _completion(reply: Reply, model: str, created: int) -> ChatCompletion:
    """The reply as a ``chat.completion``: its message (tool calls only when it has some), finish reason and usage."""
    from openai.types.chat import ChatCompletion, ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice

    tool_calls = {"tool_calls": reply.tool_calls} if reply.tool_calls else {}
    message = ChatCompletionMessage.model_validate({"role": "assistant", "content": reply.content, **tool_calls})
    return ChatCompletion(
        id=_completion_id(reply),
        object="chat.completion",
        created=created,
        model=model,
        choices=[Choice(index=0, message=message, finish_reason=reply.finish_reason, logprobs=None)],
        usage=_usage(reply),
    )


def _chunks(reply: Reply, model: str, created: int, *, include_usage: bool) -> Iterator[ChatCompletionChunk]:
    """The reply as ``chat.completion.chunk`` objects: the role and text, each tool call, the finish, the usage."""
    from openai.types.chat import ChatCompletionChunk
    from openai.types.chat.chat_completion_chunk import Choice, ChoiceDelta

    def chunk(choices: list[Choice], **usage: CompletionUsage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=_completion_id(reply),
            object="chat.completion.chunk",
            created=created,
            model=model,
            choices=choices,
            **usage,
        )

    def choice(delta: dict[str, Any], finish_reason: str | None = None) -> list[Choice]:
        return [Choice(index=0, delta=ChoiceDelta.model_validate(delta), finish_reason=finish_reason, logprobs=None)]

    yield chunk(choice({"role": "assistant", "content": reply.content or ""}))
    for index, call in enumerate(reply.tool_calls):
        yield chunk(choice({"tool_calls": [{"index": index, **call}]}))
    yield chunk(choice({}, reply.finish_reason))
    if include_usage:
        yield chunk([], usage=_usage(reply))


async def _sse(events: Iterator[ChatCompletionChunk]) -> AsyncIterator[bytes]:
    for event in events:
        yield f"data: {event.to_json(indent=None)}\n\n".encode()
    yield b"data: [DONE]\n\n"
