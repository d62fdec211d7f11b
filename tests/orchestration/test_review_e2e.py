"""The ``review`` step in whole ``rollout_batch`` runs (``dag.test()``): a batch validation warned about waits.

One batch is planned and generated once (the test run's real vLLM server, through the DAG's own steps) with a
context too short for a second turn: most rollouts end in a ``context_length`` failure row, so
the lineage suite's ``failure_row_rate`` warns (the failing thresholds it would also trip are
relaxed). Each test runs the DAG on its own copy, naming the batch: plan and generate find it
planned and committed (no engine starts), the lineage suite warns, and ``review`` waits in
``awaiting_input`` until a background thread answers: a person in headless Chromium who opens the
report from the decision form and approves (screenshots kept in ``test-artifacts/``), a rejection
through Airflow's REST API on the session's api-server, or the scheduler's own timeout sweep.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.layout import REVIEW_RECORD
from tasks.orchestration import local_airflow, steps
from tasks.orchestration.form import form_defaults

from .browser import chromium, sign_in
from .conftest import SERVERS_FIELDS, server_connection
from .hitl import AirflowRest, InBackground, answer_review, sweep_timeouts, wait_for_review

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ARTIFACTS = Path(os.environ.get("ROLLOUT_LEDGER_TEST_ARTIFACTS") or local_airflow.CHECKOUT / "test-artifacts")
BATCH = "review-e2e"
WARNED = {
    "num_tasks": 2,
    "group_size": 2,
    "shards": 1,
    "max_turns": 3,
    "max_tokens": 16,
    "max_poisoned_rate": 1.0,
    "max_capture_poisoned_rate": 1.0,
    "max_invalid_row_rate": 1.0,
}


@pytest.fixture(scope="module")
def generated(airflow_db, tmp_path_factory, vllm_server) -> SimpleNamespace:
    """The batch's storage root with its plan and its one shard committed, nothing validated yet, and its fields."""
    root = tmp_path_factory.mktemp("review-batch")
    # The first prompt has 70 tokens: no second turn fits in 84.
    fields = {**WARNED, **SERVERS_FIELDS, "engine_options": {"max_model_len": 84}}
    params = {**form_defaults(), **fields, "batch_id": BATCH, "storage_url": f"file://{root}"}
    run = SimpleNamespace(dag_id="rollout_batch", run_id="review-fixture")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(*server_connection(vllm_server))
        assert steps.plan(params, run) == [0]
        steps.generate(params, run, 0, try_number=1)
    return SimpleNamespace(root=root, fields=fields)


@pytest.fixture
def rollout_batch(airflow_db, vllm_server, monkeypatch):
    """The DAG; its runs name the test run's server by the servers connection, as the batch was planned."""
    monkeypatch.setenv(*server_connection(vllm_server))
    return local_airflow.dag_bag("rollout_batch.py").dags["rollout_batch"]


def run_conf(generated: SimpleNamespace, tmp_path: Path, **extra) -> dict:
    """The run conf of a run on a private copy of the generated batch."""
    shutil.copytree(generated.root, tmp_path / "runs")
    return {**generated.fields, "batch_id": BATCH, "storage_url": f"file://{tmp_path / 'runs'}", **extra}


def states(dag_run) -> dict[str, str]:
    tis = dag_run.get_task_instances()
    return {ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]": str(ti.state) for ti in tis}


def test_a_warned_batch_waits_and_a_person_approves_it_in_the_browser_after_reading_the_report(
    rollout_batch, generated, api_server_url, tmp_path
):
    """The approval: a person opens the decision form, follows its report link, gives a reason and presses Publish."""
    from airflow import settings
    from airflow.models.asset import AssetEvent

    conf = run_conf(generated, tmp_path)
    rest = AirflowRest(api_server_url)
    reason = "read the report: short context, known"

    def person(stop) -> dict:
        request = wait_for_review(rest, stop)
        browser = chromium(height=1600)
        try:
            seen = approve_in_browser(browser, rest, api_server_url, request["task_instance"]["dag_run_id"], reason)
        finally:
            browser.quit()
        return {"request": request, **seen}

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    seen_by = InBackground(person)
    dag_run = rollout_batch.test(run_conf=conf)
    seen = seen_by.result()

    request = seen["request"]  # what the REST API showed while the run waited
    assert request["task_instance"]["state"] == "awaiting_input" and request["options"] == ["Publish", "Reject"]
    assert "Review batch review-e2e before it is published" in seen["form"] and "Reason" in seen["form"]
    assert "the lineage suite warned (failure_row_rate)" in seen["form"]
    assert "lineage\tfailure_row_rate\t0.5\t0.05\t4" in seen["form"]  # observed, threshold, rows
    assert "rows (trainable / masked)\t4 (0 / 4)" in seen["form"]
    assert seen["buttons disabled without a reason"]
    assert seen["report url"].endswith(f"/rollout-ledger/dags/rollout_batch/runs/{dag_run.run_id}/reports/")
    assert "awaiting review" in seen["report heading"] and "passed with warnings" in seen["report heading"]
    assert "failure_row_rate" in seen["report"]
    assert "Response received at" in seen["after"] and "from admin" in seen["after"]

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
    batch = Batch.open(conf["storage_url"], BATCH)
    store = batch.store
    marker = batch.published_dataset()
    assert marker is not None and marker.review is not None and marker.review == batch.review()
    assert (marker.review.choice, marker.review.decided_by, marker.review.via, marker.review.reason) == (
        "publish",
        "admin",
        "airflow",
        reason,
    )
    assert "failure_row_rate" in marker.validation["lineage"]["warned"]  # type: ignore[index]
    assert reason in store.read_bytes(layout.DATASET_CARD).decode()
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
    batch = Batch.open(conf["storage_url"], BATCH)
    store = batch.store
    decision = batch.review()
    assert decision is not None and (decision.choice, decision.decided_by, decision.reason) == (
        "reject",
        "admin",
        "rewards are all zero",
    )
    assert batch.published_dataset() is None and not store.exists(layout.DATASET_CARD)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"batch {BATCH} was rejected: reject by admin (airflow)" in logged and "never published" in logged


def test_a_review_nobody_answers_times_out_as_a_rejection_and_fails_the_run(rollout_batch, generated, tmp_path, caplog):
    conf = run_conf(generated, tmp_path, review_timeout_hours=0.0005)  # 1.8 s
    sweeper = InBackground(sweep_timeouts)
    dag_run = rollout_batch.test(run_conf=conf)
    assert sweeper.result() >= 2

    assert str(dag_run.state) == "failed"
    assert (states(dag_run)["review"], states(dag_run)["publish"]) == ("failed", "upstream_failed")
    batch = Batch.open(conf["storage_url"], BATCH)
    store = batch.store
    decision = batch.review()
    assert decision is not None and (decision.choice, decision.reason, decision.decided_by, decision.via) == (
        "reject",
        "review_timeout",
        None,
        "timeout",
    )
    assert store.exists(REVIEW_RECORD) and batch.published_dataset() is None
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "nobody answered the review within 0.0005 hour(s)" in logged and "reject nobody answered (timeout)" in logged


def approve_in_browser(browser, rest: AirflowRest, url: str, run_id: str, reason: str) -> dict:
    """Sign in, open the run's decision form, follow its report link, come back, give a reason and press Publish."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60)
    seen = {}
    sign_in(browser, url)
    browser.get(f"{url}/dags/rollout_batch/runs/{run_id}/tasks/review/required_actions")
    link = wait.until(lambda b: b.find_elements(By.LINK_TEXT, "Open the validation report"))[0]
    publish = browser.find_element(By.CSS_SELECTOR, "[data-testid='hitl-option-Publish']")
    seen["form"] = browser.execute_script("return document.body.innerText")
    seen["buttons disabled without a reason"] = not publish.is_enabled()
    seen["report url"] = link.get_attribute("href")

    form_window = browser.current_window_handle
    link.click()  # the form opens the report in a new tab
    wait.until(lambda b: len(b.window_handles) == 2)
    browser.switch_to.window(next(h for h in browser.window_handles if h != form_window))
    seen["report heading"] = wait.until(lambda b: b.find_elements(By.TAG_NAME, "h1"))[0].text
    seen["report"] = browser.execute_script("return document.body.innerText")
    browser.save_screenshot(str(ARTIFACTS / "review-report.png"))
    browser.close()
    browser.switch_to.window(form_window)

    field = browser.find_element(By.ID, "element_reason")
    field.send_keys(reason)
    wait.until(lambda b: publish.is_enabled())
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", field)
    browser.save_screenshot(str(ARTIFACTS / "review-form.png"))
    publish.click()
    wait.until(lambda b: not rest.pending_reviews())  # the click's request reached Airflow
    browser.get(browser.current_url)
    wait.until(lambda b: "Response" in b.execute_script("return document.body.innerText"))
    seen["after"] = browser.execute_script("return document.body.innerText")
    browser.save_screenshot(str(ARTIFACTS / "review-answered.png"))
    return seen
