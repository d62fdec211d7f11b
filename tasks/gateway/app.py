"""The capture gateway's HTTP face: OpenAI-style chat completions, one route per rollout.

``POST /rollouts/{rollout_id}/v1/chat/completions`` and ``GET /rollouts/{rollout_id}/v1/models``
answer the clients of the rollouts registered in a :class:`Rollouts`. Each rollout has its own
random bearer key: a request without it, with another rollout's key, for a rollout that ended or
never existed, or beyond the rollout's call limit gets the status and OpenAI error body a client
expects (never one it retries: 401, 400 or 404), and the refusal is kept on the rollout. A
checked request goes to the rollout's :data:`Answer` (the capture path), whose :class:`Reply`
becomes a ``chat.completion`` or, with ``stream``, server-sent ``chat.completion.chunk`` events.
A request may also name the rollout's scored response in :data:`FINAL_RESPONSE_HEADER`.
"""

from __future__ import annotations

import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tasks.engines.base import SamplingSettings
from tasks.gateway.protocol import ChatRequest, GatewayError, invalid, read_chat_request

ROLLOUT_PATH = "/rollouts/{rollout_id}/v1"
# A client that cannot return a response id with its result names its scored response here, on
# any request of the rollout (a later request's value replaces an earlier one's).
FINAL_RESPONSE_HEADER = "X-Final-Response-Id"
MAX_RESPONSE_ID_CHARS = 256


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
class RolloutRoute:
    """One rollout's door: its key, the plan's sampling, its call limit, its answer, and what it refused."""

    rollout_id: str
    key: str
    sampling: SamplingSettings
    max_calls: int
    answer: Answer
    calls: int = 0
    ended: bool = False
    final_response_id: str | None = None
    refusals: list[Refusal] = field(default_factory=list)


class Rollouts:
    """The rollouts a gateway serves, each under its own random bearer key."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._routes: dict[str, RolloutRoute] = {}

    def open(self, rollout_id: str, *, sampling: SamplingSettings, max_calls: int, answer: Answer) -> RolloutRoute:
        """Register ``rollout_id``; the route holds the key its client must send."""
        if rollout_id in self._routes:
            raise ValueError(f"rollout {rollout_id!r} is already open on this gateway")
        route = RolloutRoute(rollout_id, secrets.token_urlsafe(32), sampling, max_calls, answer)
        self._routes[rollout_id] = route
        return route

    def end(self, rollout_id: str) -> RolloutRoute:
        """Refuse every later request of ``rollout_id`` (``rollout_ended``); its route stays for the record."""
        route = self._routes[rollout_id]
        route.ended = True
        return route

    def route(self, rollout_id: str, authorization: str | None) -> RolloutRoute:
        """The open route ``rollout_id`` if ``authorization`` carries its key; else GatewayError (kept on the route)."""
        route = self._routes.get(rollout_id)
        if route is None:
            raise GatewayError(
                404,
                f"no rollout {rollout_id!r} on this gateway",
                kind="invalid_request_error",
                code="rollout_not_found",
            )
        key = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(key.encode(), route.key.encode()):
            other = any(hmac.compare_digest(key.encode(), r.key.encode()) for r in self._routes.values())
            detail = "the key of another rollout" if other else "no valid key"
            raise _recorded(
                route,
                GatewayError(
                    401,
                    f"rollout {rollout_id!r} was called with {detail}",
                    kind="invalid_request_error",
                    code="invalid_api_key",
                ),
            )
        if route.ended:
            raise _recorded(route, invalid(f"rollout {rollout_id!r} has ended", code="rollout_ended"))
        return route


def _declare_final_response(route: RolloutRoute, request: Request) -> None:
    """Keep the response id ``request``'s :data:`FINAL_RESPONSE_HEADER` names, if it has one."""
    value = request.headers.get(FINAL_RESPONSE_HEADER)
    if value is None:
        return
    value = value.strip()
    if not value or len(value) > MAX_RESPONSE_ID_CHARS:
        shown = value[:40] + ("..." if len(value) > 40 else "")
        raise _recorded(
            route,
            invalid(
                f"{FINAL_RESPONSE_HEADER} must name a response id of 1 to {MAX_RESPONSE_ID_CHARS} characters, "
                f"got {shown!r}",
                code="invalid_final_response_id",
            ),
        )
    route.final_response_id = value


def _recorded(route: RolloutRoute, error: GatewayError) -> GatewayError:
    route.refusals.append(Refusal(error.status, error.code, error.message))
    return error


def create_app(rollouts: Rollouts) -> FastAPI:
    """The FastAPI application serving ``rollouts``."""
    app = FastAPI(title="rollout-ledger capture gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(GatewayError)
    async def refused(_: Request, error: GatewayError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.get(ROLLOUT_PATH + "/models")
    async def models(rollout_id: str, request: Request) -> dict[str, Any]:
        _declare_final_response(rollouts.route(rollout_id, request.headers.get("authorization")), request)
        return {"object": "list", "data": [{"id": rollouts.model, "object": "model", "owned_by": "rollout-ledger"}]}

    @app.post(ROLLOUT_PATH + "/chat/completions", response_model=None)
    async def chat_completions(rollout_id: str, request: Request) -> JSONResponse | StreamingResponse:
        route = rollouts.route(rollout_id, request.headers.get("authorization"))
        _declare_final_response(route, request)
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise _recorded(route, invalid("the request body is not JSON")) from None
        try:
            chat = read_chat_request(body, route.sampling)
            if route.calls >= route.max_calls:
                raise invalid(
                    f"rollout {rollout_id!r} made its {route.max_calls} calls (the plan's max_turns)",
                    code="max_turns_exceeded",
                )
        except GatewayError as error:
            raise _recorded(route, error) from None
        route.calls += 1
        reply = await route.answer(chat)
        created = int(time.time())
        if chat.stream:
            events = _chunks(reply, rollouts.model, created, include_usage=chat.include_usage)
            return StreamingResponse(_sse(events), media_type="text/event-stream")
        return JSONResponse(_completion(reply, rollouts.model, created))

    return app


def _message(reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return message


def _usage(reply: Reply) -> dict[str, int]:
    total = reply.prompt_tokens + reply.completion_tokens
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens, "total_tokens": total}


def _completion(reply: Reply, model: str, created: int) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{reply.call_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": _message(reply), "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": _usage(reply),
    }


def _chunks(reply: Reply, model: str, created: int, *, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The reply as ``chat.completion.chunk`` objects: the role and text, each tool call, the finish, the usage."""
    base = {"id": f"chatcmpl-{reply.call_id}", "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

    yield chunk({"role": "assistant", "content": reply.content or ""})
    for index, call in enumerate(reply.tool_calls):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, reply.finish_reason)
    if include_usage:
        yield base | {"choices": [], "usage": _usage(reply)}


async def _sse(events: Iterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    for event in events:
        yield f"data: {json.dumps(event)}\n\n".encode()
    yield b"data: [DONE]\n\n"
