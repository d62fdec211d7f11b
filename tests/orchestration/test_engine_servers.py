"""The engine servers of a DAG run, named by an Airflow connection (real ``airflow.sdk.Connection`` objects).

How a connection is read is the hook's (test_rollout_server_hook.py); here, how its servers enter a run.
"""

from __future__ import annotations

import json

import pytest

from tasks.engines.vllm_server.options import API_KEY_ENV, VllmServerOptions
from tasks.errors import ConfigError
from tasks.orchestration.engine_servers import ServerConnection, server_connection
from tasks.orchestration.generate_process import GenerateCommand
from tasks.orchestration.hooks.rollout_servers import server_pool
from tasks.orchestration.rollout_dag import generate_placement
from tasks.orchestration.storage_location import StorageLocation

KEY = "server-key-leakcheck"


def connection_of(**fields) -> ServerConnection:
    from airflow.sdk import Connection

    return ServerConnection(
        server_pool("servers", Connection(conn_id="servers", conn_type="rollout_servers", **fields))
    )


def test_the_key_is_handed_on_only_when_the_connection_has_one():
    assert connection_of(host="10.0.0.5", port=8000, password=KEY).environment()[API_KEY_ENV] == KEY
    assert connection_of(host="a", schema="https").environment() == {}


def test_a_run_reads_its_connection_through_the_hook_and_a_missing_one_is_named(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_RUN_SERVERS", json.dumps({"conn_type": "rollout_servers", "host": "h", "port": 1}))
    assert server_connection("run_servers").pool.urls == ("http://h:1",)
    monkeypatch.delenv("AIRFLOW_CONN_NO_SUCH_SERVERS", raising=False)
    with pytest.raises(ConfigError, match="engine_conn_id 'no_such_servers': no such Airflow connection"):
        server_connection("no_such_servers")


def test_the_connection_names_the_urls_of_a_vllm_server_batch_and_nothing_else():
    servers = connection_of(host="h", port=1, password=KEY)
    values = servers.batch_values({"engine": "vllm_server", "engine_options": {"max_model_len": 512}})
    assert values["engine_options"] == {"max_model_len": 512, "urls": ["http://h:1"]}
    assert KEY not in json.dumps(values)
    with pytest.raises(ConfigError, match="set engine to vllm_server, not 'vllm'"):
        servers.batch_values({"engine_options": {}})
    with pytest.raises(ConfigError, match=r"leave engine option\(s\) \['api_key_file', 'urls'\] out"):
        servers.batch_values({"engine": "vllm_server", "engine_options": {"urls": ["http://x"], "api_key_file": "k"}})


def test_a_refused_key_names_the_connection_it_came_from_never_the_key(monkeypatch):
    servers = connection_of(host="h", port=1, password=KEY)
    for name, value in servers.environment().items():
        monkeypatch.setenv(name, value)
    options = VllmServerOptions(urls=["http://h:1"])
    assert options.api_key() == KEY and options.key_source() == "the password of Airflow connection 'servers'"


def test_the_key_reaches_the_generate_process_on_its_stdin_only():
    servers = connection_of(host="h", port=1, password=KEY)
    command = GenerateCommand(StorageLocation("file:///tmp/runs"), "b1", 0, secrets=servers.environment())
    assert KEY not in " ".join(command.argv("python")) and KEY not in repr(command)
    assert KEY not in json.dumps(command.environment({"PATH": "/bin", API_KEY_ENV: KEY}))
    assert json.loads(command.handed_over())["environment"][API_KEY_ENV] == KEY


def test_generate_needs_the_gpu_pool_only_for_an_engine_that_loads_the_model_in_the_task():
    assert generate_placement("vllm") == {"pool": "gpu", "queue": "gpu"}
    assert generate_placement("megatron") == {"pool": "gpu", "queue": "gpu"}
    assert generate_placement("vllm_server") == {}


def test_a_dag_whose_default_engine_is_a_server_runs_generate_in_the_default_pool():
    from tasks.orchestration.rollout_dag import rollout_batch_dag

    defaults = {"engine": "vllm_server", "engine_options": {"urls": ["http://h:1"]}}
    assert rollout_batch_dag("served", defaults=defaults).get_task("generate").pool == "default_pool"
    assert rollout_batch_dag().get_task("generate").pool == "gpu"
