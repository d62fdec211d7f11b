"""One running vLLM server seen from a client: its HTTP calls, its life, and what each failure means to a shard.

A server that cannot be reached, drops a connection mid-call, or fails its health check after a
server error, is lost: a :class:`ReplicaDeadError` (an :class:`~tasks.errors.EngineDeadError`:
the rollouts in flight on it are re-run, on another replica or by the retry). So is a server
whose start identity changed (it restarted: its weights and version are its start-up ones) or
whose weight version went down; a lost replica stays lost for this client, and every call in
flight on it ends the same way. An answer that refuses one request is a
:class:`ServerAnswerError` (an engine error of that call); a refused API key (HTTP 401 or 403) is a
:class:`ServerAuthError` naming where the key came from and how to give one, never the key.

The start identity is vLLM's ``instance_id`` (``/server_info``: set once when the server process
builds its config), read when the client connects and again after every answer that arrived
over a connection not seen before: a restarted server is only reached over a new connection.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import weakref
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from tasks.engines.base import WeightVersionSpan
from tasks.engines.vllm_server.options import API_KEY_ENV
from tasks.engines.vllm_server.serving.keys import generated_key_path, is_loopback
from tasks.errors import ConfigError, EngineDeadError, EngineError

# The server's answer is cut to this many characters in messages.
DETAIL_CHARS = 300
SERVER_INFO_PATH = "/server_info"
HEALTH_PATH = "/health"
# The header a router in front of several servers hashes on (vLLM router's consistent_hash policy).
SESSION_HEADER = "X-Session-ID"


class ServerAuthError(ConfigError):
    """A server refused the API key (HTTP 401 or 403)."""

    reason = "server_auth"


def key_advice(url: str) -> str:
    """How to give a server's key, for a refusal's message: the three ways, and where ``serve`` wrote its key
    (this machine's file for the URL's port when there is one). Names files and variables, never a key."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    written = generated_key_path(port)
    if parts.hostname and is_loopback(parts.hostname) and written.is_file():
        served = f"`rollout-ledger serve` on this machine wrote the key of port {port} to {written}"
    else:
        served = f"`rollout-ledger serve` writes its key to {generated_key_path(0).parent}/port-<port>.key"
    return (
        "give the servers' key as the engine option api_key_file (--engine-option api_key_file=PATH; refit: "
        f"--api-key-file PATH), as ${API_KEY_ENV}, or under Airflow as the password of the batch's rollout_servers "
        f"connection; {served}"
    )


class ServerAnswerError(EngineError):
    """A server answered a call with an HTTP error; ``status`` is its code."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class ReplicaDeadError(EngineDeadError):
    """The replica at ``url`` is lost (unreachable, restarted, its weight version went down, it aborted a call)."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url


def start_identity(server_info: Any, url: str) -> str:
    """What names one start of the server process: ``vllm_config.instance_id`` of its ``/server_info``."""
    config = server_info.get("vllm_config") if isinstance(server_info, dict) else None
    identity = config.get("instance_id") if isinstance(config, dict) else None
    if not isinstance(identity, str) or not identity:
        raise EngineError(f"server {url} reports no instance_id in /server_info; its restarts could not be seen")
    return identity


class ServerReplica:
    """HTTP client of one ``vllm serve`` at ``url``.

    ``in_flight`` counts the calls it is serving for us, ``answered`` the answers accepted from it;
    ``identity`` and ``weight_version`` are what it reported last (set when the engine connects);
    ``lost`` is the error that lost it, or ``None`` while it lives.
    """

    def __init__(self, url: str, *, api_key: str | None, key_source: str, timeout_s: float) -> None:
        self.url = url
        self.in_flight = 0
        self.answered = 0
        self.identity = ""
        self.weight_version = 0
        self.lost: ReplicaDeadError | None = None
        self._key_source = key_source if api_key else "a call without an API key (none was given)"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(
            base_url=url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits
        )
        self._verified: weakref.WeakSet[Any] = weakref.WeakSet()  # connections known to reach the known identity
        self._ticks = itertools.count()  # orders answers and identity checks
        self._verified_before = 0  # every answer with a tick below this one came from the identity known
        self._verifying = asyncio.Lock()

    async def get(self, path: str, **params: Any) -> Any:
        """GET ``path``; its JSON body."""
        return (await self._call("GET", path, params=params or None))[0]

    async def post(self, path: str, body: dict[str, Any] | None = None, **params: Any) -> Any:
        """POST ``body`` as JSON to ``path``; its JSON body (``None`` for an empty one)."""
        return (await self._call("POST", path, json=body, params=params or None))[0]

    async def generate(self, path: str, body: dict[str, Any], session_id: str | None) -> tuple[Any, int]:
        """POST a model call; (its answer, the weight version known when it was sent).

        The answer is given only while the replica lives: one that came over a new connection, or
        an HTTP refusal, first has the server's identity confirmed (:meth:`_confirm_identity`), and
        a server error its health (:meth:`_confirm_healthy`).
        """
        self.check_alive()
        sent_version = self.weight_version
        headers = {SESSION_HEADER: session_id} if session_id is not None else None
        self.in_flight += 1
        try:
            try:
                answer, connection = await self._call("POST", path, json=body, headers=headers)
            except ServerAnswerError as refused:  # a dying or restarted server's refusal is no failure of the call
                if refused.status >= 500:
                    await self._confirm_healthy(refused)
                await self._confirm_identity(next(self._ticks))
                raise
            if connection is None or connection not in self._verified:
                await self._confirm_identity(next(self._ticks))
                self._remember(connection)
        except ReplicaDeadError as error:
            raise self.lose(error) from None
        finally:
            self.in_flight -= 1
        self.check_alive()
        return answer, sent_version

    def accept(self, spans: Sequence[WeightVersionSpan], sent_version: int, request_id: str) -> None:
        """Take an answer's weight spans; a version below the one known when it was sent loses the replica."""
        self.check_alive()
        versions = [span.version for span in spans]
        if versions != sorted(versions) or versions[0] < sent_version:
            raise self.lose(
                ReplicaDeadError(
                    self.url,
                    f"request {request_id}: server {self.url} sampled with weight version(s) {versions} after "
                    f"serving version {sent_version}: its version went down (a restart or a rollback)",
                )
            )
        self.weight_version = max(self.weight_version, versions[-1])
        self.answered += 1

    def lose(self, error: ReplicaDeadError) -> ReplicaDeadError:
        """Mark the replica lost (the first error stays its reason); the error to raise."""
        if self.lost is None:
            self.lost = error
        return error

    def check_alive(self) -> None:
        """Raise the error that lost the replica, if it is lost."""
        if self.lost is not None:
            raise ReplicaDeadError(self.url, f"server {self.url} is lost: {self.lost}")

    async def _confirm_healthy(self, refused: ServerAnswerError) -> None:
        """Lose the replica when its ``/health`` fails after it ``refused`` a call with a server error.

        vLLM answers every call HTTP 500 once its engine core is gone (a shutdown, a crash), and
        ``/health`` 503; a server error on a healthy server is that call's failure.
        """
        try:
            await self._call("GET", HEALTH_PATH)
        except ServerAnswerError as unhealthy:
            raise self.lose(
                ReplicaDeadError(
                    self.url, f"{refused}; its {HEALTH_PATH} answers HTTP {unhealthy.status}: its engine is gone"
                )
            ) from None

    async def _confirm_identity(self, tick: int) -> None:
        """Confirm that an answer given at ``tick`` came from the server start known at connect.

        One identity read that starts after the answer arrived covers it: reads are serialized, and
        answers that arrived before a finished read started need no read of their own.
        """
        async with self._verifying:
            if tick < self._verified_before:
                return
            started = next(self._ticks)
            info, connection = await self._call("GET", SERVER_INFO_PATH, params={"config_format": "json"})
            identity = start_identity(info, self.url)
            if identity != self.identity:
                raise self.lose(
                    ReplicaDeadError(
                        self.url,
                        f"server {self.url} restarted (instance {self.identity} is now {identity}): its weights and "
                        "version are its start-up ones, so no answer of it is taken any more",
                    )
                )
            self._verified_before = started
            self._remember(connection)

    def _remember(self, connection: Any) -> None:
        if connection is not None:
            self._verified.add(connection)

    async def _call(self, method: str, path: str, **kwargs: Any) -> tuple[Any, Any]:
        """(JSON body, the connection it came over: httpcore's network stream)."""
        try:
            response = await self._client.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise EngineError(f"server {self.url}: {method} {path} timed out ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise ReplicaDeadError(self.url, f"server {self.url} is unreachable: {type(exc).__name__}: {exc}") from None
        connection = response.extensions.get("network_stream")  # None: unknown, so never taken as verified
        if response.status_code in (401, 403):
            raise ServerAuthError(
                f"server {self.url} refused {self._key_source} (HTTP {response.status_code} on {path}); "
                + key_advice(self.url)
            )
        if response.status_code >= 400:
            raise ServerAnswerError(
                f"server {self.url}: {method} {path} answered HTTP {response.status_code}: "
                f"{response.text[:DETAIL_CHARS]}",
                status=response.status_code,
            )
        if not response.content:
            return None, connection
        try:
            return response.json(), connection
        except json.JSONDecodeError:
            raise EngineError(
                f"server {self.url}: {method} {path} answered with no JSON: {response.text[:DETAIL_CHARS]!r}"
            ) from None

    async def close(self) -> None:
        await self._client.aclose()
