"""One running vLLM server seen from a client: its HTTP calls, and what each failure means to a shard.

A server that cannot be reached, or drops a connection mid-call, is an
:class:`~tasks.errors.EngineDeadError` (the attempt ends; the retry adopts what was committed); an
answer that refuses one request is a :class:`ServerAnswerError` (an engine error of that call); a refused
API key is a :class:`ServerAuthError` naming where the key came from, never the key.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from tasks.errors import ConfigError, EngineDeadError, EngineError

# The server's answer is cut to this many characters in messages.
DETAIL_CHARS = 300


class ServerAuthError(ConfigError):
    """A server refused the API key (HTTP 401)."""

    reason = "server_auth"


class ServerAnswerError(EngineError):
    """A server answered a call with an HTTP error; ``status`` is its code."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class ServerReplica:
    """HTTP client of one ``vllm serve`` at ``url``; ``in_flight`` counts the calls it is serving for us."""

    def __init__(self, url: str, *, api_key: str | None, key_source: str, timeout_s: float) -> None:
        self.url = url
        self.in_flight = 0
        self._key_source = key_source if api_key else "a call without an API key (none was given)"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(
            base_url=url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits
        )

    async def get(self, path: str, **params: Any) -> Any:
        """GET ``path``; its JSON body."""
        return await self._call("GET", path, params=params or None)

    async def post(self, path: str, body: dict[str, Any] | None = None, **params: Any) -> Any:
        """POST ``body`` as JSON to ``path``; its JSON body (``None`` for an empty one)."""
        return await self._call("POST", path, json=body, params=params or None)

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self._client.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise EngineError(f"server {self.url}: {method} {path} timed out ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise EngineDeadError(f"server {self.url} is unreachable: {type(exc).__name__}: {exc}") from None
        if response.status_code == 401:
            raise ServerAuthError(f"server {self.url} refused {self._key_source} (HTTP 401 on {path})")
        if response.status_code >= 400:
            raise ServerAnswerError(
                f"server {self.url}: {method} {path} answered HTTP {response.status_code}: "
                f"{response.text[:DETAIL_CHARS]}",
                status=response.status_code,
            )
        if not response.content:
            return None
        try:
            return response.json()
        except json.JSONDecodeError:
            raise EngineError(
                f"server {self.url}: {method} {path} answered with no JSON: {response.text[:DETAIL_CHARS]!r}"
            ) from None

    async def close(self) -> None:
        await self._client.aclose()
