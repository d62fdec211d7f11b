"""One local Airflow per test run (SQLite metadata DB in a temporary folder), set up before anything imports airflow.

Airflow reads its settings when first imported, so the variables are applied when pytest loads
this file; the ``airflow_db`` fixture migrates the DB and creates the ``gpu`` pool once.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tasks.orchestration import local_airflow
from tasks.orchestration.engine_servers import SERVERS_CONN_ID, servers_connection_variable
from tasks.trigger_policy import POLICY_VARIABLE
from tests.policies import write_trigger_policy

AIRFLOW_TEST_HOME = Path(tempfile.mkdtemp(prefix="rollout-ledger-airflow-")) / "airflow"
local_airflow.apply(local_airflow.airflow_environment(AIRFLOW_TEST_HOME))
S3_TEST_CONN_ID = "ledger_s3"  # the storage connection the S3 runs name
# A triggered batch on the test run's vLLM server: named by the servers connection (server_connection), as the
# trigger policy asks.
SERVERS_FIELDS = {"engine": "vllm_server", "engine_options": {}, "engine_conn_id": SERVERS_CONN_ID}


# The tests' runs keep their batches in temporary folders, and name the S3 connection.
os.environ[POLICY_VARIABLE] = str(
    write_trigger_policy(
        AIRFLOW_TEST_HOME.parent / "trigger_policy.yaml",
        storage_urls=[f"file://{tempfile.gettempdir()}", f"file://{Path.cwd()}"],
        storage_connections=[S3_TEST_CONN_ID],
    )
)


@pytest.fixture
def allow_storage(monkeypatch, tmp_path_factory):
    """Allow the runs of this test one more storage URL (an S3 bucket of its own) in the trigger policy."""

    def allow(url: str) -> None:
        path = tmp_path_factory.mktemp("policy") / "trigger_policy.yaml"
        urls = [f"file://{tempfile.gettempdir()}", f"file://{Path.cwd()}", url]
        monkeypatch.setenv(
            POLICY_VARIABLE, str(write_trigger_policy(path, storage_urls=urls, storage_connections=[S3_TEST_CONN_ID]))
        )

    return allow


@pytest.fixture(scope="session")
def airflow_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The migrated metadata DB and the ``gpu`` pool of this run's Airflow home.

    ``local_airflow.prepare`` (``airflow db migrate`` and ``airflow pools set``, two Airflow CLI starts) runs once per
    test run: on a pytest-xdist worker, the first to need it prepares a template home in the run's shared temporary
    folder, and every worker copies its DB and passwords file into its own home (each worker keeps a DB of its own).
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        local_airflow.prepare(AIRFLOW_TEST_HOME, os.environ)
    else:
        _copy_prepared_home(tmp_path_factory.getbasetemp().parent / "airflow-template", AIRFLOW_TEST_HOME)
    from airflow import settings

    settings.configure_orm()
    return AIRFLOW_TEST_HOME


def _copy_prepared_home(shared: Path, home: Path) -> None:
    """Prepare ``shared/airflow`` once for the whole test run (under a lock), then copy its DB and passwords into
    ``home``, the files ``prepare`` would have made there."""
    import fcntl
    import shutil

    template = shared / "airflow"
    shared.mkdir(parents=True, exist_ok=True)
    with (shared / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "prepared").exists():
            local_airflow.prepare(template, {**os.environ, **local_airflow.airflow_environment(template)})
            (shared / "prepared").touch()
        home.mkdir(parents=True, exist_ok=True)
        passwords = Path(os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
        shutil.copyfile(template / "simple_auth_manager_passwords.json", passwords)
        shutil.copyfile(template / "airflow.db", home / "airflow.db")


@pytest.fixture(scope="session")
def dag_bag():
    """Every DAG file of ``dags/``, parsed the way the DAG processor parses them."""
    return local_airflow.dag_bag()


@pytest.fixture(scope="session")
def api_server_url(airflow_db, tmp_path_factory):
    """One ``airflow api-server`` of this run's Airflow (DB, DAGs, plugins) on loopback, shared by the tests."""
    from .browser import api_server

    with api_server(tmp_path_factory.mktemp("api-server") / "api-server.log") as url:
        yield url


def server_connection(server) -> tuple[str, str]:
    """The environment variable (name, value) defining :data:`SERVERS_CONN_ID` as the ``rollout_servers``
    connection of ``server``: host, port, password = its API key."""
    return servers_connection_variable(server.url, server.key)


@pytest.fixture(scope="session")
def published_run(airflow_db, tmp_path_factory, vllm_server):
    """One successful ``rollout_batch`` run (2 shards, params from the run conf) on the test run's vLLM server,
    refit to weight version 3 as a trainer would before planning: ``(dag_run, conf)``. The server is named by
    the Airflow ``rollout_servers`` connection :data:`SERVERS_CONN_ID` (host, port, password = the server's API key)."""
    dag = local_airflow.dag_bag("rollout_batch.py").dags["rollout_batch"]
    root = tmp_path_factory.mktemp("published-run")
    conf = {
        "num_tasks": 4,
        "group_size": 2,
        "shards": 2,
        "max_turns": 3,
        "max_tokens": 16,
        "weight_version": 3,
        "storage_url": f"file://{root}",
        "engine": "vllm_server",
        "engine_options": {"max_model_len": 2048},
        "engine_conn_id": SERVERS_CONN_ID,
    }
    with pytest.MonkeyPatch.context() as patch, vllm_server.at_weight_version(3):
        patch.setenv(*server_connection(vllm_server))
        return dag.test(run_conf=conf), conf
