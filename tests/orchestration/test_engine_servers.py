"""The engine servers of a DAG run, named by an Airflow http connection (real ``airflow.sdk.Connection`` objects)."""

from __future__ import annotations

import json

import pytest

from tasks.engines.vllm_server.options import API_KEY_ENV, VllmServerOptions
from tasks.errors import ConfigError
from tasks.orchestration.engine_servers import server_connection, servers_of_connection
from tasks.orchestration.generate_process import GenerateCommand
from tasks.orchestration.rollout_dag import generate_placement
from tasks.orchestration.storage_location import StorageLocation

KEY = "server-key-leakcheck"


def connection(**fields):
    from airflow.sdk import Connection

    return Connection(conn_id="servers", **{"conn_type": "http", **fields})


def test_host_and_port_are_the_first_server_the_extra_adds_replicas_and_the_password_is_the_key():
    conn = connection(host="10.0.0.5", port=8000, password=KEY, extra=json.dumps({"urls": ["https://b.example:9"]}))
    servers = servers_of_connection("servers", conn)
    assert servers.urls == ("http://10.0.0.5:8000", "https://b.example:9")
    assert servers.environment()[API_KEY_ENV] == KEY
    assert KEY not in repr(servers)
    assert servers_of_connection("s", connection(host="https://a.example/v", password="")).urls == (
        "https://a.example/v",
    )
    assert servers_of_connection("s", connection(host="a", schema="https")).environment() == {}


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"conn_type": "aws", "host": "a"}, "is a 'aws' connection; name the servers in an 'http' connection"),
        ({}, "names no server: set its host"),
        ({"host": "a", "extra": json.dumps({"urls": "http://b"})}, "extra urls must be a list of URLs"),
    ],
)
def test_a_connection_that_names_no_servers_is_refused(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        servers_of_connection("servers", connection(**fields))


def test_a_missing_connection_is_named(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_NO_SUCH_SERVERS", raising=False)
    with pytest.raises(ConfigError, match="engine_conn_id 'no_such_servers': no such Airflow connection"):
        server_connection("no_such_servers")


def test_the_connection_names_the_urls_of_a_vllm_server_batch_and_nothing_else():
    servers = servers_of_connection("servers", connection(host="h", port=1, password=KEY))
    values = servers.batch_values({"engine": "vllm_server", "engine_options": {"max_model_len": 512}})
    assert values["engine_options"] == {"max_model_len": 512, "urls": ["http://h:1"]}
    assert KEY not in json.dumps(values)
    with pytest.raises(ConfigError, match="set engine to vllm_server, not 'vllm'"):
        servers.batch_values({"engine_options": {}})
    with pytest.raises(ConfigError, match=r"leave engine option\(s\) \['api_key_file', 'urls'\] out"):
        servers.batch_values({"engine": "vllm_server", "engine_options": {"urls": ["http://x"], "api_key_file": "k"}})


def test_a_refused_key_names_the_connection_it_came_from_never_the_key(monkeypatch):
    servers = servers_of_connection("servers", connection(host="h", port=1, password=KEY))
    for name, value in servers.environment().items():
        monkeypatch.setenv(name, value)
    options = VllmServerOptions(urls=["http://h:1"])
    assert options.api_key() == KEY and options.key_source() == "the password of Airflow connection 'servers'"


def test_the_key_reaches_the_generate_process_by_environment_only():
    servers = servers_of_connection("servers", connection(host="h", port=1, password=KEY))
    command = GenerateCommand(StorageLocation("file:///tmp/runs"), "b1", 0, secrets=servers.environment())
    assert KEY not in " ".join(command.argv("python")) and KEY not in repr(command)
    assert command.environment({"PATH": "/bin"})[API_KEY_ENV] == KEY


def test_generate_needs_the_gpu_pool_only_for_an_engine_that_loads_the_model_in_the_task():
    assert generate_placement("vllm") == {"pool": "gpu", "queue": "gpu"}
    assert generate_placement("megatron") == {"pool": "gpu", "queue": "gpu"}
    assert generate_placement("vllm_server") == {}


def test_a_dag_whose_default_engine_is_a_server_runs_generate_in_the_default_pool():
    from tasks.orchestration.rollout_dag import rollout_batch_dag

    defaults = {"engine": "vllm_server", "engine_options": {"urls": ["http://h:1"]}}
    assert rollout_batch_dag("served", defaults=defaults).get_task("generate").pool == "default_pool"
    assert rollout_batch_dag().get_task("generate").pool == "gpu"
