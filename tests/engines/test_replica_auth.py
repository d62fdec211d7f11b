"""A server that refuses the API key (HTTP 401 or 403): the client's error names where the key came from and the
ways to give one, never the key (a FAKE server answers; the real one: tests/test_cli.py)."""

from __future__ import annotations

import asyncio

import pytest

from tasks.engines.vllm_server.replica import ServerAuthError, ServerReplica
from tasks.models.bundled import cache_dir

from .fake_keyed_server import fake_keyed_server

KEY = "wrong-key-5f1c2a"
WAYS = (
    "give the servers' key as the engine option api_key_file (--engine-option api_key_file=PATH; refit: "
    "--api-key-file PATH), as $ROLLOUT_LEDGER_SERVER_API_KEY, or under Airflow as the password of the batch's "
    "rollout_servers connection"
)


def refusal(url: str, api_key: str | None = KEY, source: str = "the key in /keys/servers.key") -> str:
    async def call() -> None:
        replica = ServerReplica(url, api_key=api_key, key_source=source, timeout_s=10)
        try:
            await replica.get("/v1/models")
        finally:
            await replica.close()

    with pytest.raises(ServerAuthError) as refused:
        asyncio.run(call())
    assert KEY not in str(refused.value)
    return str(refused.value)


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_key_says_where_it_came_from_and_how_to_give_one(status, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_LEDGER_HOME", str(tmp_path))
    with fake_keyed_server(status) as url:
        assert refusal(url) == (
            f"server {url} refused the key in /keys/servers.key (HTTP {status} on /v1/models); {WAYS}; "
            f"`rollout-ledger serve` writes its key to {tmp_path}/serve/port-<port>.key"
        )
        assert refusal(url, api_key=None).startswith(
            f"server {url} refused a call without an API key (none was given) (HTTP {status} on /v1/models); {WAYS}"
        )


def test_the_key_file_serve_wrote_for_the_servers_port_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_LEDGER_HOME", str(tmp_path))
    with fake_keyed_server(401) as url:
        port = int(url.rpartition(":")[2])
        written = cache_dir() / "serve" / f"port-{port}.key"
        written.parent.mkdir()
        written.write_text("the-served-key-not-shown\n")
        message = refusal(url, source="$ROLLOUT_LEDGER_SERVER_API_KEY")
    assert message == (
        f"server {url} refused $ROLLOUT_LEDGER_SERVER_API_KEY (HTTP 401 on /v1/models); {WAYS}; `rollout-ledger "
        f"serve` on this machine wrote the key of port {port} to {written}"
    )
    assert "the-served-key-not-shown" not in message
