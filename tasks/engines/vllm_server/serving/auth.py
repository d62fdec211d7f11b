"""The API key on every route of a ``rollout-ledger serve`` server; only ``/health`` answers without it.

vLLM 0.32's own key check (``--api-key`` / ``VLLM_API_KEY``) guards only paths under ``/v1``,
``/v2``, ``/inference`` and ``/cohere``: with ``VLLM_SERVER_DEV_MODE=1`` the RL and dev endpoints
(``/pause``, ``/collective_rpc``, ``/update_weights``, ``/sleep``, ...) and ``/metrics`` answer any
process that reaches the port.

Design choice: no reverse proxy. vLLM's documented ``--middleware IMPORT.PATH`` hook adds a class
to its FastAPI app with ``app.add_middleware`` after its own middleware, so :class:`RequireKey`
is the outermost layer of vLLM's app and sees every HTTP and websocket request before any route,
mounted app (``/metrics``) or plugin route: no second port, hop or process to manage, and
streaming answers pass through untouched. Invariants: the key is read from ``VLLM_API_KEY``
once, in the server's own process (a server started without one refuses to start); a request is
let through only with ``Authorization: Bearer <key>`` (compared with :func:`hmac.compare_digest`
on SHA-256 digests, so neither content nor length leaks through timing) or when its path is
exactly ``/health``; the key is never logged or echoed. Inside the guard, :class:`~.records.ServeRecords`
keeps the server's weight records (its routes need the key like every other).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tasks.engines.vllm_server.serving.keys import KEY_ENV
from tasks.engines.vllm_server.serving.records import ServeRecords

OPEN_PATHS = frozenset({"/health"})  # the bare liveness check


class RequireKey:
    """ASGI middleware: a request without the server's bearer key is refused (HTTP 401, websocket close 1008)."""

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{KEY_ENV} is not set: a rollout-ledger serve server needs an API key")
        self.app = ServeRecords(app)
        self._digest = hashlib.sha256(key.encode()).digest()

    def admits(self, headers: Headers) -> bool:
        """Whether ``headers`` carry ``Authorization: Bearer <the key>`` (scheme case-insensitive)."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = hashlib.sha256(token.encode()).digest()
        return hmac.compare_digest(given, self._digest) and scheme.lower() == "bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self.admits(Headers(scope=scope)):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            refusal = JSONResponse({"error": "Unauthorized"}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await refusal(scope, receive, send)
