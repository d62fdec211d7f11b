"""The vLLM servers a DAG run calls, named by an Airflow connection, and how they enter the run's batch.

:class:`~tasks.orchestration.hooks.rollout_servers.RolloutServerHook` reads the connection (the
servers' URLs and API key). The plan task writes the URLs into the batch config (engine option
``urls``); the key reaches plan's server check and the generate process in
:data:`~tasks.engines.vllm_server.options.API_KEY_ENV` only, never XCom, logs or the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tasks.batch_fields import field_default
from tasks.engines.vllm_server.options import API_KEY_ENV, API_KEY_SOURCE_ENV
from tasks.errors import ConfigError
from tasks.orchestration.provider_info import SERVERS_DEFAULT_CONN_ID

if TYPE_CHECKING:
    from tasks.orchestration.hooks.rollout_servers import ServerPool

SERVER_ENGINE = "vllm_server"
SERVERS_CONN_ID = SERVERS_DEFAULT_CONN_ID  # the connection the rollout_batch_on_servers form starts from
OPTIONS_FROM_CONNECTION = ("urls", "api_key_file")


@dataclass(frozen=True)
class ServerConnection:
    """The servers of one connection, as a run hands them to its batch (URLs) and to its processes (the key)."""

    pool: ServerPool

    def environment(self) -> dict[str, str]:
        """The key as the variable the engine reads it from, and where it came from (``{}`` without a key)."""
        if not self.pool.api_key:
            return {}
        return {API_KEY_ENV: self.pool.api_key, API_KEY_SOURCE_ENV: self.pool.key_source()}

    def batch_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The batch values with these servers as engine option ``urls``; a ConfigError when they name others."""
        conn_id = self.pool.conn_id
        engine = values.get("engine", field_default("engine"))
        if engine != SERVER_ENGINE:
            raise ConfigError(
                f"engine_conn_id {conn_id!r} names vLLM servers: set engine to {SERVER_ENGINE}, not {engine!r}"
            )
        options = dict(values.get("engine_options") or {})
        named = sorted(set(options) & set(OPTIONS_FROM_CONNECTION))
        if named:
            raise ConfigError(
                f"engine_conn_id {conn_id!r} names the servers and their key: leave engine option(s) {named} out"
            )
        return {**values, "engine_options": {**options, "urls": list(self.pool.urls)}}


def server_connection(conn_id: str) -> ServerConnection:
    """The servers Airflow connection ``conn_id`` names; a ConfigError when it does not exist or names none."""
    from airflow.sdk.exceptions import AirflowNotFoundException

    from tasks.orchestration.hooks.rollout_servers import RolloutServerHook

    try:
        return ServerConnection(RolloutServerHook(conn_id).get_conn())
    except AirflowNotFoundException:
        raise ConfigError(f"engine_conn_id {conn_id!r}: no such Airflow connection") from None


def servers_connection_variable(url: str, key: str, conn_id: str = SERVERS_CONN_ID) -> tuple[str, str]:
    """The environment variable (name, value) that defines Airflow connection ``conn_id`` as the ``rollout_servers``
    connection of the server at ``url``: host, port, password = its API key (the demo's and the tests' servers)."""
    import json
    from urllib.parse import urlsplit

    from tasks.orchestration.provider_info import SERVERS_CONN_TYPE

    parts = urlsplit(url)
    connection = {"conn_type": SERVERS_CONN_TYPE, "host": parts.hostname, "port": parts.port, "password": key}
    return f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(connection)
