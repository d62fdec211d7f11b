"""One ``rollout_batch`` run on a real Celery deployment (:mod:`tests.deploy.celery_deployment`) against ``dag.test()``.

The deployment is PostgreSQL, Redis, scheduler, dag-processor, api-server and two Celery workers
on loopback: ``gpu-worker`` serves queue ``gpu``, ``cpu-worker`` queue ``default``. The batch is
triggered through the REST API, its storage is the moto S3 server reached only through an Airflow
connection created through the REST API (the components' environment has no AWS variables). The
test checks that the run succeeded with one task instance for each task the parsed DAG declares
(generate once per shard; review skipped, since both suites pass), that each ran on the worker of
its task's queue, generate on the gpu worker and every other task on the cpu worker (as the
metadata DB records it: host name, queue, and the Celery task id each worker logged), and that
the published dataset and the ledger's call records equal, row for row, those of the same conf
run with ``airflow dags test`` (``dag.test()``) on a SQLite Airflow.

It takes several minutes (two vLLM-CPU engines per run), so it is marked ``deploy`` and runs from
``make test-deploy``; the components' logs stay in ``<basetemp>/.../logs``.
"""

from __future__ import annotations

import json
import operator
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.batch import Batch
from tasks.orchestration import local_airflow, steps
from tasks.storage.dataset_manifest import read_dataset_marker
from tasks.storage.ledger_reader import LedgerReader
from tasks.trigger_policy import POLICY_VARIABLE
from tests.deploy.celery_deployment import WORKERS, celery_deployment
from tests.policies import write_trigger_policy

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(2400)]  # deploy only: `-m e2e` must not pull it in

DAG_ID = "rollout_batch"
CONN_ID = "ledger_s3"
SMALL = {
    "num_tasks": 2,
    "group_size": 2,
    "shards": 2,
    "max_turns": 2,
    "max_tokens": 16,
    "environment": "arithmetic",
    "environment_options": {},
}
RUN_TIMEOUT = 1200.0
# Both suites pass on this batch: review runs on its worker and skips itself (nobody is asked).
SKIPPED_ON_A_CLEAN_BATCH = {"review"}
# Columns that name the batch or record when and where something was written: they differ between two
# runs of the same conf by construction. Everything else (tokens, masks, rewards, advantages, chain and
# cumulative hashes, ids) must be equal, except the sampling logprobs' last bits: vLLM-CPU's float32
# kernels may reduce in another order in another process (a Celery worker vs `airflow dags test`;
# seen: 7.6e-7), so logprobs agree within LOGPROB_TOLERANCE and the call digest, which covers them,
# is left out here (both suites recomputed every digest of both batches before publish).
DATASET_RUN_COLUMNS = ("batch_id",)
CALL_RUN_COLUMNS = ("batch_id", "admitted_at", "staging_segment", "staging_row", "digest")
LOGPROB_TOLERANCE = 1e-4


def test_a_batch_on_celery_workers_runs_generate_on_the_gpu_queue_and_equals_dag_test(
    tmp_path, s3_endpoint, s3_bucket, monkeypatch
):
    policy = write_trigger_policy(
        tmp_path / "trigger_policy.yaml", storage_urls=[s3_bucket], storage_connections=[CONN_ID]
    )
    monkeypatch.setenv(POLICY_VARIABLE, str(policy))  # the deployment lists the bucket and its connection
    connection = {
        "conn_type": "aws",
        "login": "testing",
        "password": "testing",
        "extra": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"},
    }
    conf = {**SMALL, "storage_url": f"{s3_bucket}/runs", "storage_conn_id": CONN_ID}

    with celery_deployment(tmp_path / "deployment") as deployment:
        deployment.api(
            "POST",
            "/connections",
            {"connection_id": CONN_ID, **{k: v for k, v in connection.items() if k != "extra"}}
            | {"extra": json.dumps(connection["extra"])},
        )
        deployment.services.wait_until(
            f"DAG {DAG_ID} parsed", lambda: deployment.api("GET", f"/dags/{DAG_ID}") is not None, timeout=240
        )
        deployment.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})
        run_id = deployment.trigger(DAG_ID, conf)
        state = deployment.wait_for_run(DAG_ID, run_id, timeout=RUN_TIMEOUT)
        task_instances = deployment.task_instances(DAG_ID, run_id)
        received = {worker: deployment.celery_task_ids(worker) for worker in WORKERS}
        assert state == "success", f"run {run_id} {state}: {task_instances}\n{deployment.services.tails()}"

    by_task = {(ti["task_id"], ti["map_index"]): ti for ti in task_instances}
    dag = local_airflow.dag_bag("rollout_batch.py").dags[DAG_ID]
    assert sorted(by_task) == expected_task_instances(dag, shards=SMALL["shards"])
    for (task_id, map_index), ti in by_task.items():
        worker = next(w for w, queue in WORKERS.items() if queue == dag.get_task(task_id).queue)
        other = next(w for w in WORKERS if w != worker)
        where = f"{task_id}[{map_index}]: {ti}"
        assert ti["state"] == ("skipped" if task_id in SKIPPED_ON_A_CLEAN_BATCH else "success"), where
        assert (ti["hostname"], ti["queue"]) == (worker, WORKERS[worker]), where
        assert ti["external_executor_id"] in received[worker], where
        assert ti["external_executor_id"] not in received[other], where
    assert by_task[("generate", 0)]["pool"] == "gpu"

    reference_run = run_with_dag_test(tmp_path / "reference", conf, connection)
    storage_options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    deployed = Batch.open(conf["storage_url"], steps.batch_id_for_run(DAG_ID, run_id), storage_options).store
    reference = Batch.open(conf["storage_url"], steps.batch_id_for_run(DAG_ID, reference_run), storage_options).store
    assert deployed.url != reference.url

    deployed_rows, reference_rows = published_rows(deployed), published_rows(reference)
    assert deployed_rows.num_rows == 4
    assert_same_rows(deployed_rows, reference_rows, key="rollout_id", excluded=DATASET_RUN_COLUMNS, close=("logprobs",))
    for shard in range(SMALL["shards"]):
        deployed_ledger, reference_ledger = LedgerReader(deployed, shard).tables, LedgerReader(reference, shard).tables
        assert deployed_ledger.calls.num_rows > 0
        assert_same_rows(deployed_ledger.calls, reference_ledger.calls, key="call_id", excluded=CALL_RUN_COLUMNS)
        assert_same_rows(deployed_ledger.receipts, reference_ledger.receipts, key="rollout_id", excluded=())


def expected_task_instances(dag, *, shards: int) -> list[tuple[str, int]]:
    """(task id, map index) of every task instance a run of ``dag`` makes: a mapped task's once per shard."""
    return sorted((t.task_id, i) for t in dag.tasks for i in (range(shards) if t.is_mapped else (-1,)))


def run_with_dag_test(root: Path, conf: dict, connection: dict) -> str:
    """The same conf through ``airflow dags test`` (``dag.test()``) on a fresh SQLite Airflow; returns its run id."""
    home = root / "airflow"
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "AIRFLOW"))}
    environment.update(local_airflow.airflow_environment(home))
    environment["AIRFLOW_CONN_LEDGER_S3"] = json.dumps(connection)
    environment["PYTHONPATH"] = str(local_airflow.CHECKOUT)
    local_airflow.prepare(home, environment)
    command = [sys.executable, "-m", "airflow", "dags", "test", DAG_ID, "-c", json.dumps(conf)]
    log = root / "dags-test.log"
    with log.open("wb") as out:
        result = subprocess.run(
            command, check=False, env=environment, stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT
        )
    text = log.read_text(errors="replace")
    assert result.returncode == 0, f"airflow dags test exited {result.returncode}:\n{text[-5000:]}"
    with sqlite3.connect(home / "airflow.db") as db:
        ((run_id, state),) = db.execute("SELECT run_id, state FROM dag_run WHERE dag_id = ?", (DAG_ID,)).fetchall()
    assert state == "success", f"dag.test run {run_id} {state}:\n{text[-5000:]}"
    return run_id


def published_rows(store) -> pa.Table:
    marker = read_dataset_marker(store)
    assert marker is not None, f"{store.url}: no dataset/_COMMITTED.json"
    return pa.concat_tables(pq.read_table(store.full_path(p.path), filesystem=store.fs) for p in marker.parts)


def assert_same_rows(
    deployed: pa.Table, reference: pa.Table, *, key: str, excluded: tuple[str, ...], close: tuple[str, ...] = ()
) -> None:
    """Equal once ``excluded`` columns are dropped and rows ordered by ``key`` (float lists of ``close`` columns
    within :data:`LOGPROB_TOLERANCE`, of equal lengths); else name the first difference."""
    assert deployed.schema == reference.schema
    left = deployed.drop_columns(list(excluded)).sort_by(key)
    right = reference.drop_columns(list(excluded)).sort_by(key)
    assert left.num_rows == right.num_rows
    keys = left.column(key).to_pylist()
    for name in left.column_names:
        ours, theirs = left.column(name).to_pylist(), right.column(name).to_pylist()
        same = _close if name in close else operator.eq
        differing = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if not same(a, b)]
        assert not differing, (
            f"column {name} differs in {len(differing)} row(s); first: {key} {keys[differing[0]]}: "
            f"deployed {ours[differing[0]]!r}, dag.test {theirs[differing[0]]!r}"
        )


def _close(ours: list[float], theirs: list[float]) -> bool:
    return len(ours) == len(theirs) and all(abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(ours, theirs, strict=True))
