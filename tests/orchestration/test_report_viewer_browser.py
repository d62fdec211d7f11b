"""The report viewer in a real browser: headless Debian Chromium logs in to Airflow's UI (the session's api-server),
opens a finished run's "Validation report" tab, and finds the overview page with its plots rendered inside the UI,
then its Data Docs.

The screenshot is kept as a test artifact (``$ROLLOUT_LEDGER_TEST_ARTIFACTS``, default ``test-artifacts/``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.orchestration import local_airflow
from tasks.orchestration.steps import run_batch_id

from .browser import chromium, open_report_tab, sign_in

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ARTIFACTS = Path(os.environ.get("ROLLOUT_LEDGER_TEST_ARTIFACTS") or local_airflow.CHECKOUT / "test-artifacts")


def test_a_user_opens_the_validation_report_of_a_run_in_the_airflow_ui(published_run, api_server_url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    dag_run, conf = published_run
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    url = api_server_url
    browser = chromium()
    wait = WebDriverWait(browser, 60)
    try:
        sign_in(browser, url)

        source = open_report_tab(browser, wait, url, dag_run.dag_id, dag_run.run_id)
        assert "/rollout-ledger/dags/rollout_batch/runs/" in source
        heading = wait.until(lambda b: b.find_elements(By.TAG_NAME, "h1"))[0].text
        assert run_batch_id(conf, dag_run) in heading and "validation passed" in heading and "published" in heading
        plots = [svg for svg in browser.find_elements(By.TAG_NAME, "svg") if svg.size["width"] > 100]
        assert len(plots) >= 4 and all(svg.size["height"] > 50 for svg in plots)
        text = browser.execute_script("return document.body.innerText")
        assert "Lineage passed" in text and "Dataset passed" in text
        data_docs = [a.get_attribute("href") for a in browser.find_elements(By.PARTIAL_LINK_TEXT, "Data Docs")]
        assert len(data_docs) == 2
        browser.switch_to.default_content()
        browser.save_screenshot(str(ARTIFACTS / "report-viewer.png"))

        browser.get(data_docs[0])  # a Data Docs page, served by the viewer with the UI's session cookie
        wait.until(lambda b: "Validation Results" in b.page_source or "Expectation Suites" in b.page_source)
        assert browser.current_url == data_docs[0]  # at its own address: no redirect
        assert data_docs[0].endswith("/reports/lineage/run-000/index.html")
    finally:
        browser.quit()
