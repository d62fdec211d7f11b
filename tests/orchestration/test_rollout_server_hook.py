"""The ``rollout_servers`` connection type: what a connection names, its key masked, its Test button, its UI form.

The Test button's servers are FAKES (tests/orchestration/fake_servers.py: the endpoints it reads,
no model); Airflow's ProvidersManager and connection code are real, in this process.
"""

from __future__ import annotations

import json

import pytest

from tasks.errors import ConfigError
from tasks.orchestration.hooks.rollout_servers import RolloutServerHook, server_pool
from tasks.orchestration.provider_info import SERVERS_CONN_TYPE as CONN_TYPE

from .fake_servers import fake_servers

KEY = "server-key-leakcheck"


def connection(**fields):
    from airflow.sdk import Connection

    return Connection(conn_id="servers", **{"conn_type": CONN_TYPE, **fields})


def define(monkeypatch, conn_id: str, **fields) -> None:
    """Connection ``conn_id`` as Airflow reads it from the environment."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": CONN_TYPE, **fields}))


@pytest.mark.parametrize("conn_type", [CONN_TYPE, "http"])
def test_host_and_port_are_the_first_server_the_extra_adds_replicas_and_the_password_is_the_key(conn_type):
    conn = connection(
        conn_type=conn_type, host="10.0.0.5", port=8000, password=KEY, extra=json.dumps({"urls": ["https://b.e:9"]})
    )
    pool = server_pool("servers", conn)
    assert pool.urls == ("http://10.0.0.5:8000", "https://b.e:9") and pool.api_key == KEY
    assert KEY not in repr(pool)
    assert server_pool("s", connection(host="https://a.example/v", password="")).urls == ("https://a.example/v",)
    assert server_pool("s", connection(host="a", schema="https")).api_key is None
    assert server_pool("s", connection(extra=json.dumps({"urls": ["http://b:1"]}))).urls == ("http://b:1",)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (
            {"conn_type": "aws", "host": "a"},
            "is a 'aws' connection; name the servers in a 'rollout_servers' connection",
        ),
        ({}, "names no server: set its host"),
        ({"host": "a", "extra": json.dumps({"urls": "http://b"})}, "extra urls must be a list of URLs"),
    ],
)
def test_a_connection_that_names_no_servers_is_refused(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        server_pool("servers", connection(**fields))


def test_reading_the_connection_hands_its_key_to_the_secrets_masker(monkeypatch):
    import airflow.sdk.log
    from airflow.sdk.log import redact

    masked = []
    monkeypatch.setattr(airflow.sdk.log, "mask_secret", lambda secret, name=None: masked.append(secret))
    define(monkeypatch, "masked_servers", host="h", port=1, password=KEY)
    assert RolloutServerHook("masked_servers").get_conn().urls == ("http://h:1",)
    assert masked == [KEY]
    monkeypatch.undo()
    define(monkeypatch, "masked_servers", host="h", port=1, password=KEY)
    RolloutServerHook("masked_servers").get_conn()
    assert redact(f"the key is {KEY}") == "the key is ***"


def test_the_test_button_reads_each_server_with_the_key_and_says_what_it_serves(monkeypatch):
    with fake_servers("policy", "policy", key=KEY) as (a, b):
        define(
            monkeypatch, "servers", host="127.0.0.1", port=a.server_address[1], password=KEY, extra={"urls": [b.url]}
        )
        ok, message = RolloutServerHook("servers").test_connection()
    assert ok, message
    assert message == (
        f"2 server(s) answer with the connection's key: {a.url} serves policy (512 tokens) at weight version 0; "
        f"{b.url} serves policy (512 tokens) at weight version 0"
    )
    assert a.asked[0] == ("/health", f"Bearer {KEY}") and ("/v1/models", f"Bearer {KEY}") in a.asked


def test_the_test_button_fails_naming_what_a_run_would_refuse_never_the_key(monkeypatch):
    def test(**fields) -> str:
        define(monkeypatch, "servers", **fields)
        ok, message = RolloutServerHook("servers").test_connection()
        assert not ok and KEY not in message and "not-the-key" not in message
        return message

    with fake_servers("policy", "other", key=KEY) as (a, b):
        assert test(host=a.url, password="not-the-key-leakcheck").startswith(
            f"server {a.url} refused the password of Airflow connection 'servers' (HTTP 401 on /v1/models); give "
            "the servers' key as the engine option api_key_file"
        )
        assert test(host=a.url).startswith(f"server {a.url} refused a call without an API key")
        assert test(host=a.url, password=KEY, extra={"urls": [b.url]}).startswith(f"replicas differ: {a.url} serves")
    assert test(host=a.url, password=KEY).startswith(f"server {a.url} is unreachable")


def test_airflow_lists_the_connection_type_with_its_form_and_tests_it_as_the_api_does(monkeypatch):
    from airflow.api_fastapi.core_api.services.ui.connections import HookMetaService
    from airflow.models.connection import Connection
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    assert "rollout-ledger" in manager.providers
    (meta,) = [m for m in HookMetaService.hook_meta_data() if m.connection_type == CONN_TYPE]  # what the UI reads
    assert meta.hook_name == RolloutServerHook.hook_name
    assert meta.hook_class_name == "tasks.orchestration.hooks.rollout_servers.RolloutServerHook"
    assert meta.standard_fields.login.hidden and meta.standard_fields.password.title == "API key"
    assert meta.extra_fields["urls"]["schema"]["type"] == ["array", "null"]
    with fake_servers("policy", key=KEY) as (server,):
        tested = Connection(conn_id="tested_servers", conn_type=CONN_TYPE, host=server.url, password=KEY)
        monkeypatch.setenv("AIRFLOW_CONN_TESTED_SERVERS", tested.get_uri())  # as POST /connections/test does
        served = f"{server.url} serves policy (512 tokens) at weight version 0"
        assert tested.test_connection() == (True, f"1 server(s) answer with the connection's key: {served}")
