"""The Airflow connection type of a pool of vLLM servers: what a connection names, and its Test button.

A ``rollout_servers`` connection names the servers a batch calls: ``host`` and ``port`` are the
first (``schema`` is the scheme, ``http`` by default; a host may also be a whole base URL), the
extra ``urls`` lists more replicas of the same model, and the password is the servers' API key.
An ``http`` connection (the type server connections had before this one) reads the same way.
The key goes to Airflow's secrets masker as soon as the connection is read, and into no message
or ``repr``.

The type's form in Airflow's UI is declared in :mod:`tasks.orchestration.provider_info`, as
Airflow 3.3 asks (a hook's ``get_connection_form_widgets``/``get_ui_field_behaviour`` are deprecated).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from airflow.sdk import BaseHook

from tasks.errors import ConfigError
from tasks.orchestration.provider_info import (
    SERVERS_CONN_TYPE,
    SERVERS_DEFAULT_CONN_ID,
    SERVERS_EXTRA_URLS,
    SERVERS_HOOK_NAME,
)

READ_TYPES = (SERVERS_CONN_TYPE, "http")  # http: the type server connections had before this one
TEST_TIMEOUT_S = 10.0  # per request of the Test button


@dataclass(frozen=True)
class ServerPool:
    """The base URLs a connection names, in order, and the servers' API key (left out of ``repr``)."""

    conn_id: str
    urls: tuple[str, ...]
    api_key: str | None = field(default=None, repr=False)

    def key_source(self) -> str:
        """Where the key comes from, in words (for messages: never the key)."""
        return f"the password of Airflow connection {self.conn_id!r}"


def server_pool(conn_id: str, conn: Any) -> ServerPool:
    """The servers Airflow connection object ``conn`` names; a ConfigError when it names none or is another type."""
    if conn.conn_type not in READ_TYPES:
        raise ConfigError(
            f"engine_conn_id {conn_id!r} is a {conn.conn_type!r} connection; name the servers in a "
            f"{SERVERS_CONN_TYPE!r} connection (host, port, password = API key)"
        )
    urls = [_base_url(conn)] if conn.host else []
    more = conn.extra_dejson.get(SERVERS_EXTRA_URLS) or []
    if not isinstance(more, list) or not all(isinstance(url, str) for url in more):
        raise ConfigError(
            f"engine_conn_id {conn_id!r}: extra {SERVERS_EXTRA_URLS} must be a list of URLs, got {more!r}"
        )
    urls += more
    if not urls:
        raise ConfigError(f"engine_conn_id {conn_id!r} names no server: set its host (and port), or extra urls")
    return ServerPool(conn_id, tuple(urls), conn.password or None)


class RolloutServerHook(BaseHook):
    """The vLLM servers of connection ``rollout_servers_conn_id``: :meth:`get_conn` reads them, :meth:`test_connection`
    asks each one what it serves."""

    conn_name_attr = "rollout_servers_conn_id"
    default_conn_name = SERVERS_DEFAULT_CONN_ID
    conn_type = SERVERS_CONN_TYPE
    hook_name = SERVERS_HOOK_NAME

    def __init__(self, rollout_servers_conn_id: str = default_conn_name) -> None:
        super().__init__()
        self.rollout_servers_conn_id = rollout_servers_conn_id

    def get_conn(self) -> ServerPool:
        """The servers the connection names; its password is masked in every log from here on."""
        from airflow.sdk.log import mask_secret

        conn = self.get_connection(self.rollout_servers_conn_id)
        if conn.password:
            mask_secret(conn.password)
        return server_pool(self.rollout_servers_conn_id, conn)

    def test_connection(self) -> tuple[bool, str]:
        """(ok, message): each server's ``/health``, then what it serves, read with the key as a run reads it."""
        try:
            return True, asyncio.run(describe_servers(self.get_conn()))
        except Exception as exc:  # the Test button shows the message; none holds the key
            return False, str(exc)


async def describe_servers(pool: ServerPool, timeout_s: float = TEST_TIMEOUT_S) -> str:
    """What each server of ``pool`` serves, in one line; raises what a run's start would (unreachable, a refused
    key, no RL endpoints, replicas that serve different models)."""
    from tasks.engines.vllm_server.claims import ReplicaVersionsDifferError, check_claims, read_claim
    from tasks.engines.vllm_server.replica import HEALTH_PATH, ServerReplica

    replicas = [
        ServerReplica(url, api_key=pool.api_key, key_source=pool.key_source(), timeout_s=timeout_s) for url in pool.urls
    ]
    try:
        claims = []
        for replica in replicas:
            await replica.get(HEALTH_PATH)
            claims.append(await read_claim(replica))
    finally:
        await asyncio.gather(*(replica.close() for replica in replicas))
    with contextlib.suppress(ReplicaVersionsDifferError):  # mid-refit: a run waits for them to agree
        check_claims(claims)
    served = "; ".join(
        f"{c.url} serves {c.model} ({c.max_model_len} tokens) at weight version {c.weight_version}"
        + (", paused" if c.paused else "")
        for c in claims
    )
    keyed = "with the connection's key" if pool.api_key else "without a key"
    return f"{len(claims)} server(s) answer {keyed}: {served}"


def _base_url(conn: Any) -> str:
    if "://" in conn.host:
        return conn.host
    port = f":{conn.port}" if conn.port else ""
    return f"{conn.schema or 'http'}://{conn.host}{port}"
