"""Whole ``rollout_batch`` runs with ``dag.test()``: real Airflow tasks calling the test run's real vLLM server.

A run with params from the run conf publishes its dataset and the asset event; a run of
``rollout_batch_on_servers`` reaches the server and the moto S3 server only through Airflow
connections, its generate in the default pool; a failing suite fails the run, publishes
nothing, and its lineage carries the failed assertion. Airflow retrying a generate task killed
midway: ``test_crash_trials_e2e.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.orchestration import local_airflow, steps
from tasks.orchestration.storage_location import storage_location
from tests.lineage.graph import descendants

from .conftest import SERVERS_FIELDS, server_connection
from .lineage_events import reported, task_events, task_runs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
EXAMPLES = Path(__file__).parents[2] / "examples"
SMALL = {"num_tasks": 2, "group_size": 2, "shards": 1, "max_turns": 3, "max_tokens": 16}


@pytest.fixture
def rollout_batch(airflow_db):
    return local_airflow.dag_bag("rollout_batch.py").dags["rollout_batch"]


def states(dag_run) -> dict[str, str]:
    tis = dag_run.get_task_instances()
    return {ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.rendered_map_index}]": str(ti.state) for ti in tis}


def published_rows(where, batch_id: str):
    batch = Batch.open(where.root_url, batch_id, where.storage_options)
    marker = batch.published_dataset()
    assert marker is not None, "no dataset/_COMMITTED.json"
    table = pq.read_table(batch.store.full_path(marker.parts[0].path), filesystem=batch.store.fs)
    return batch, marker, table


def test_a_run_with_params_from_the_run_conf_publishes_the_dataset_and_the_asset_event(published_run):
    from airflow import settings
    from airflow.models.asset import AssetEvent

    dag_run, conf = published_run
    assert states(dag_run) == {
        "plan": "success",
        "generate[shard 0]": "success",
        "generate[shard 1]": "success",
        "validate_lineage": "success",
        "finalize": "success",
        "validate_dataset": "success",
        "review": "skipped",  # both suites passed: nobody is asked
        "publish": "success",
        "sweep_orphans": "success",
    }
    batch_id = steps.run_batch_id(conf, dag_run)
    where = storage_location(conf["storage_url"])
    batch, marker, table = published_rows(where, batch_id)
    store, planned = batch.store, batch.config
    assert (planned.num_tasks, planned.shards, planned.sampling.max_tokens, planned.weight_version) == (4, 2, 16, 3)
    assert marker.rows == table.num_rows == 8 and set(marker.validation) == {"lineage", "dataset"}
    assert marker.review is None  # nobody reviewed: publish recorded that it needed no review, and nothing else
    recorded = batch.review()
    assert recorded is not None
    assert (recorded.choice, recorded.via, recorded.decided_by) == ("publish", "validation", None)
    assert store.exists("reports/index.html")
    assert {batch.suite_summary(suite).status for suite in ("lineage", "dataset")} == {"passed"}
    with settings.Session() as session:
        (event,) = session.query(AssetEvent).filter(AssetEvent.source_run_id == dag_run.run_id).all()
    assert event.extra["batch_id"] == batch_id and event.extra["rows"] == 8 and event.extra["weight_version"] == 3
    assert event.extra["dataset"] == f"{store.url}/dataset"
    # what the example consumer does with the event
    assert steps.published_dataset(event.extra)["parts"] == [p.path for p in marker.parts]


def test_the_engine_servers_connection_names_the_servers_and_its_key_stays_out_of_xcom_and_the_batch(
    published_run, vllm_server
):
    from airflow import settings
    from airflow.models.xcom import XComModel

    dag_run, conf = published_run
    batch_id = steps.run_batch_id(conf, dag_run)
    batch = Batch.open(storage_location(conf["storage_url"]).root_url, batch_id)
    assert batch.config.engine.options == {"max_model_len": 2048, "urls": [vllm_server.url]}  # from the connection
    assert batch.config.model.weights == "verified"  # the server's folder is on this machine and hashes the same
    key = vllm_server.key
    with settings.Session() as session:
        values = [row.value for row in session.query(XComModel).filter(XComModel.run_id == dag_run.run_id)]
    assert values and key not in json.dumps(values, default=str) and key not in json.dumps(dag_run.conf)
    for path in Path(batch.store.full_path(layout.plan_config())).parents[1].rglob("*"):
        assert not path.is_file() or key.encode() not in path.read_bytes(), f"{path} holds the API key"


def test_a_run_on_servers_and_s3_reaches_both_only_through_airflow_connections(
    airflow_db, s3_endpoint, s3_bucket, monkeypatch, vllm_server, allow_storage
):
    """``rollout_batch_on_servers`` with its form's engine defaults: the servers come from its connection, and
    generate runs in the default pool (it loads no model). Its environment is the registry's agent command
    ``command_agent_example`` (``examples/command_agent.py``, dags/environments.yaml), picked in the form with a
    trigger option: the agent calls the model through the attempt's capture gateway."""
    allow_storage(f"{s3_bucket}/runs")  # the deployment's trigger policy lists the bucket, before the DAG is parsed
    on_servers = local_airflow.dag_bag("rollout_batch_on_servers.py").dags["rollout_batch_on_servers"]
    monkeypatch.setenv(*server_connection(vllm_server))
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    connection = {
        "conn_type": "aws",
        "login": "testing",
        "password": "testing",
        "extra": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_LEDGER_S3", json.dumps(connection))
    conf = {
        **SMALL,
        "environment": "command_agent_example",
        "environment_options": {"timeout_s": 240},
        "storage_url": f"{s3_bucket}/runs",
        "storage_conn_id": "ledger_s3",
    }
    dag_run = on_servers.test(run_conf=conf)
    tasks = states(dag_run)
    assert tasks.pop("review") == "skipped" and set(tasks.values()) == {"success"}  # both suites passed
    assert {ti.pool for ti in dag_run.get_task_instances() if ti.task_id == "generate"} == {"default_pool"}
    where = storage_location(conf["storage_url"], "ledger_s3")
    batch, marker, table = published_rows(where, steps.run_batch_id(conf, dag_run))
    assert marker.rows == table.num_rows == 4
    assert "testing" not in json.dumps(dag_run.conf) and "testing" not in str(batch.config.to_json())
    assert batch.config.engine.options == {"urls": [vllm_server.url]}
    assert vllm_server.key not in json.dumps(batch.config.to_json())
    dataset = (s3_bucket, f"runs/batches/{batch.batch_id}/dataset")
    tasks_file = str(EXAMPLES / "arithmetic_tasks.jsonl")
    assert dataset in descendants(task_events(dag_run), ("file", tasks_file))  # task file -> dataset, on S3
    assert batch.config.environment == "command_agent_example" and len(batch.config.environment_options["sha256"]) == 64
    assert batch.config.environment_options["command"] == ["{python}", str(EXAMPLES / "command_agent.py")]


def test_a_failing_suite_fails_the_run_with_its_report_in_the_log_and_publishes_nothing(
    rollout_batch, tmp_path, caplog, vllm_server, monkeypatch
):
    monkeypatch.setenv(*server_connection(vllm_server))
    conf = {
        **SMALL,
        **SERVERS_FIELDS,
        "environment": "arithmetic",
        "environment_options": {},
        "max_turns": 1,
        "reward_max": -1.0,  # every reward is above it: the dataset suite's rewards_within_bounds fails
        "storage_url": f"file://{tmp_path}",
    }
    dag_run = rollout_batch.test(run_conf=conf)
    assert str(dag_run.state) == "failed"
    assert states(dag_run) == {
        "plan": "success",
        "generate[shard 0]": "success",
        "validate_lineage": "success",
        "finalize": "success",
        "validate_dataset": "failed",
        "review": "upstream_failed",
        "publish": "upstream_failed",
        "sweep_orphans": "success",
    }
    batch = Batch.open(f"file://{tmp_path}", steps.run_batch_id(conf, dag_run))
    store = batch.store
    assert batch.staged_dataset() is not None and batch.published_dataset() is None
    assert batch.suite_summary("dataset").status == "failed"
    failure = next(r.getMessage() for r in caplog.records if "the dataset suite failed the batch" in r.getMessage())
    assert "rewards_within_bounds" in failure and f"report: {store.url}/reports/dataset/run-000/index.html" in failure
    events = task_events(dag_run)  # its lineage: the failed assertion, in a run that ends in FAIL
    (suite_run,) = reported(events, "validate_dataset")
    (dataset,) = suite_run["inputs"]
    assertions = dataset["inputFacets"]["dataQualityAssertions"]["assertions"]
    assert [(a["name"], a["column"]) for a in assertions if not a["success"]] == [("rewards_within_bounds", "reward")]
    run_states = [e["eventType"] for e in task_runs(events)[suite_run["run"]["runId"]]]
    assert run_states == ["START", "RUNNING", "FAIL"]
