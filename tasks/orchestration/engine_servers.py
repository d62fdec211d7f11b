"""The vLLM servers a DAG run calls, named by an Airflow connection: their URLs and their API key.

An ``http`` connection names a pool of servers: ``host`` and ``port`` are the first (``schema``
is the scheme, ``http`` by default; a host may also be a whole base URL), the extra
``{"urls": [...]}`` adds replicas, and the password is the API key. The plan task writes the URLs
into the batch config (engine option ``urls``); the key reaches plan's server check and the
generate process in :data:`~tasks.engines.vllm_server.options.API_KEY_ENV` only, never XCom,
logs or the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks.batch_fields import field_default
from tasks.engines.vllm_server.options import API_KEY_ENV, API_KEY_SOURCE_ENV
from tasks.errors import ConfigError

SERVER_ENGINE = "vllm_server"
SERVERS_CONN_ID = "rollout_servers"  # the connection the rollout_batch_on_servers form starts from
CONNECTION_TYPE = "http"
OPTIONS_FROM_CONNECTION = ("urls", "api_key_file")


@dataclass(frozen=True)
class ServerConnection:
    """The servers of connection ``conn_id`` and their API key (keep private: it is left out of ``repr``)."""

    conn_id: str
    urls: tuple[str, ...]
    api_key: str | None = field(default=None, repr=False)

    def environment(self) -> dict[str, str]:
        """The key as the variable the engine reads it from, and where it came from (``{}`` without a key)."""
        if not self.api_key:
            return {}
        return {API_KEY_ENV: self.api_key, API_KEY_SOURCE_ENV: f"the password of Airflow connection {self.conn_id!r}"}

    def batch_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The batch values with these servers as engine option ``urls``; a ConfigError when they name others."""
        engine = values.get("engine", field_default("engine"))
        if engine != SERVER_ENGINE:
            raise ConfigError(
                f"engine_conn_id {self.conn_id!r} names vLLM servers: set engine to {SERVER_ENGINE}, not {engine!r}"
            )
        options = dict(values.get("engine_options") or {})
        named = sorted(set(options) & set(OPTIONS_FROM_CONNECTION))
        if named:
            raise ConfigError(
                f"engine_conn_id {self.conn_id!r} names the servers and their key: leave engine option(s) {named} out"
            )
        return {**values, "engine_options": {**options, "urls": list(self.urls)}}


def servers_of_connection(conn_id: str, conn: Any) -> ServerConnection:
    """The servers an Airflow connection object names (its type, host, port, schema, extra and password)."""
    if conn.conn_type != CONNECTION_TYPE:
        raise ConfigError(
            f"engine_conn_id {conn_id!r} is a {conn.conn_type!r} connection; name the servers in an "
            f"{CONNECTION_TYPE!r} connection (host, port, password = API key)"
        )
    urls = [_base_url(conn)] if conn.host else []
    extra = conn.extra_dejson.get("urls", [])
    if not isinstance(extra, list) or not all(isinstance(url, str) for url in extra):
        raise ConfigError(f"engine_conn_id {conn_id!r}: extra urls must be a list of URLs, got {extra!r}")
    urls += extra
    if not urls:
        raise ConfigError(f"engine_conn_id {conn_id!r} names no server: set its host (and port), or extra urls")
    return ServerConnection(conn_id, tuple(urls), conn.password or None)


def server_connection(conn_id: str) -> ServerConnection:
    """The servers Airflow connection ``conn_id`` names; a ConfigError when it does not exist or names none."""
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = Connection.get(conn_id)
    except AirflowNotFoundException:
        raise ConfigError(f"engine_conn_id {conn_id!r}: no such Airflow connection") from None
    return servers_of_connection(conn_id, conn)


def _base_url(conn: Any) -> str:
    if "://" in conn.host:
        return conn.host
    port = f":{conn.port}" if conn.port else ""
    return f"{conn.schema or 'http'}://{conn.host}{port}"
