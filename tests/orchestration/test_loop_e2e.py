"""The loop on a real Airflow: checkpoint events posted through the REST API start asset-triggered runs.

The test run's Airflow home (conftest: SQLite metadata DB) with an api-server, a scheduler and a
DAG processor of its own (the api-server serves the execution API the scheduler's LocalExecutor
tasks call, so they share a JWT secret), started as ``make demo-loop`` starts them. An external
trainer's ``POST /api/v2/assets/events`` of a checkpoint below the deployment's checkpoints root
makes the scheduler start ``policy_refit_batch``, whose ``verify_checkpoint`` hashes the folder and
hands on the verified event; an event naming a folder outside the root fails that task without a
retry, naming the root, and nothing after it runs. (The rest of the run, a batch at the checkpoint,
is ``make demo-loop``'s; here the run has no servers connection, so ``refit`` fails, named.)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tasks.orchestration import local_airflow, loop
from tasks.orchestration.loop_api import AirflowApi, announce_checkpoint
from tasks.orchestration.loop_dag import REFIT_DAG_ID

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
RUN_TIMEOUT = 300


@pytest.fixture(scope="module")
def loop_airflow(airflow_db, tmp_path_factory):
    """(REST API as the local login, checkpoints root) of the test Airflow with its scheduler and DAG processor."""
    from tasks.orchestration.loop_demo import airflow_processes, components_environment, free_port, loop_dags_folder

    root = tmp_path_factory.mktemp("checkpoints")
    port = free_port()
    dags = loop_dags_folder(tmp_path_factory.mktemp("loop-dags"))
    environment = {**os.environ, **components_environment(port, dags), loop.CHECKPOINTS_ROOT_VARIABLE: str(root)}
    with airflow_processes(environment, port, tmp_path_factory.mktemp("loop-airflow-logs")) as url:
        api = AirflowApi.login(url, *local_airflow.LOGIN)
        deadline = time.monotonic() + RUN_TIMEOUT
        while (
            api.asset_id(loop.POLICY_CHECKPOINT_ASSET) is None
            or api.client.get(f"/api/v2/dags/{REFIT_DAG_ID}").status_code != 200
        ):
            assert time.monotonic() < deadline, "the DAG processor did not parse policy_refit_batch"
            time.sleep(1)
        api.unpause(REFIT_DAG_ID)
        yield api, root
        api.close()


def finished_run(api: AirflowApi, after: set[str]) -> dict:
    """The first ``policy_refit_batch`` run not in ``after``, once it is done."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while time.monotonic() < deadline:
        runs = api.client.get(f"/api/v2/dags/{REFIT_DAG_ID}/dagRuns", params={"order_by": "id"}).json()["dag_runs"]
        new = [run for run in runs if run["dag_run_id"] not in after]
        if new and new[0]["state"] in ("success", "failed"):
            return new[0]
        time.sleep(2)
    raise TimeoutError("no policy_refit_batch run finished")


def states(api: AirflowApi, run_id: str) -> dict[str, str | None]:
    path = f"/api/v2/dags/{REFIT_DAG_ID}/dagRuns/{run_id}/taskInstances"
    return {ti["task_id"]: ti["state"] for ti in api.client.get(path).json()["task_instances"]}


def task_log(run_id: str, task_id: str) -> str:
    return "\n".join(path.read_text() for path in attempts(run_id, task_id))


def attempts(run_id: str, task_id: str) -> list[Path]:
    logs = Path(os.environ["AIRFLOW_HOME"]) / "logs" / f"dag_id={REFIT_DAG_ID}" / f"run_id={run_id}"
    return sorted((logs / f"task_id={task_id}").glob("attempt=*.log"))


def test_checkpoint_events_posted_through_the_rest_api_start_verified_runs_and_a_foreign_folder_is_refused(
    loop_airflow,
):
    from .test_loop import chain

    api, root = loop_airflow
    (zero,) = chain(root, 1)
    extra = loop.manifest_event(zero, zero.folder).to_extra()

    posted = announce_checkpoint(api, extra)
    assert posted["extra"] == extra | {loop.FROM_REST_API: True}
    run = finished_run(api, set())
    assert run["run_type"] == "asset_triggered"
    found = states(api, run["dag_run_id"])
    assert found["verify_checkpoint"] == "success"
    path = f"/api/v2/dags/{REFIT_DAG_ID}/dagRuns/{run['dag_run_id']}/taskInstances/verify_checkpoint/xcomEntries"
    xcom = api.client.get(f"{path}/return_value", params={"deserialize": "true", "stringify": "false"}).json()["value"]
    assert xcom == extra | {"folder": str(zero.folder.resolve())}
    assert found["refit"] == "failed"  # this Airflow has no rollout_servers connection
    assert "engine_conn_id 'rollout_servers': no such Airflow connection" in task_log(run["dag_run_id"], "refit")

    outside = root.parent / "elsewhere" / "step-000000"
    outside.parent.mkdir()
    zero.folder.rename(outside)  # the same checkpoint, outside the root
    refused = announce_checkpoint(api, extra | {"folder": str(outside)})
    run = finished_run(api, {run["dag_run_id"]})
    assert refused["extra"]["folder"] == str(outside)
    found = states(api, run["dag_run_id"])
    assert found["verify_checkpoint"] == "failed"
    assert found["refit"] == found["plan"] == "upstream_failed"
    log = task_log(run["dag_run_id"], "verify_checkpoint")
    assert f"is not below the deployment's checkpoints root {root}" in log
    assert len(attempts(run["dag_run_id"], "verify_checkpoint")) == 1  # refused: no retry
