"""Helpers of the report viewer's tests: DAG runs whose plan task recorded a batch, and a batch of Data Docs alone.

:class:`Listener` is a loopback server that keeps every request it gets: what escaped a report. It listens on
:data:`LISTENER_HOST`, not the api-server's ``127.0.0.1``: a browser sends a host's cookies to every port of it,
so a listener there would get Airflow's session cookie with any request, whatever the page did.
A run needs only its DAG in the metadata DB (:func:`sync_dags`, or a session's ``published_run``);
the viewer reads nothing of a batch but its ``reports/``, so :func:`data_docs_batch` writes that
folder alone: one real Data Docs site built by :func:`~tasks.validate.gx_run.run_gx_suite` (vendored
assets included) and a small overview page linking its index and its one validation result page, as
the real overview page links each table's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

import pyarrow as pa

from tasks.orchestration.batch_xcom import BATCH_XCOM_KEY, PLAN_TASK_ID

LISTENER_HOST = "127.0.0.2"  # another loopback host than the api-server's (browser.py lets Chromium reach both)
DOCS_INDEX = "lineage/run-000/index.html"
OVERVIEW = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>overview</title></head>
<body><h1>Batch overview</h1><p><a href="{index}">lineage Data Docs</a>, results by table: <a href="{result}">calls</a>
</p></body></html>
"""
# What a Data Docs page shows of its style sheets, fonts and images, and which files it loaded.
STYLED = """
const icon = document.querySelector('.fas, .fa');
return {
  jquery: typeof window.jQuery,
  font: getComputedStyle(document.body).fontFamily,
  navbar: getComputedStyle(document.querySelector('nav.navbar')).display,
  container: getComputedStyle(document.querySelector('.container-fluid')).paddingLeft,
  iconFont: icon && getComputedStyle(icon, '::before').fontFamily,
  iconLoaded: document.fonts.check('900 16px "Font Awesome 6 Free"'),
  logo: document.querySelector('img[src$="logo-long.png"]').naturalWidth,
  text: document.body.innerText,
  loaded: performance.getEntriesByType('resource').map((entry) => entry.name),
};
"""
# What Chromium logs for each script of a page the report policy's sandbox keeps from running.
SCRIPT_BLOCKED = "because the document's frame is sandboxed and the 'allow-scripts' permission is not set"


def sync_dags() -> None:
    """This checkout's DAGs written to the metadata DB, as the DAG processor writes them."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import sync_bag_to_db

    from tasks.orchestration import local_airflow

    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(local_airflow.dag_bag(), "dags-folder", None)


def register_run(dag_id: str, run_id: str, record: dict) -> None:
    """A finished run of ``dag_id`` (never executed) whose plan task recorded ``record``."""
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.models.xcom import XComModel
    from airflow.sdk import timezone
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType

    with create_session() as session:
        SerializedDagModel.get_dag(dag_id, session=session).create_dagrun(
            run_id=run_id,
            run_after=timezone.utcnow(),
            run_type=DagRunType.MANUAL,
            triggered_by=DagRunTriggeredByType.TEST,
            state=DagRunState.SUCCESS,
            session=session,
        )
        session.flush()
        XComModel.set(BATCH_XCOM_KEY, record, dag_id=dag_id, task_id=PLAN_TASK_ID, run_id=run_id, session=session)


def data_docs_batch(root: Path, batch_id: str) -> Path:
    """``root/batches/<batch_id>/reports/``: an overview page and the Data Docs of a lineage suite run; returned."""
    from tasks.validate.gx_run import run_gx_suite
    from tasks.validate.suites import ExpectationSpec, SuiteSpec, TableSpec

    reports = root / "batches" / batch_id / "reports"
    table = TableSpec("calls", "call_id", "call records")
    kwargs = {"column": "call_id"}
    unique = ExpectationSpec("unique_calls", "calls", "expect_column_values_to_be_unique", kwargs, "warn", "Unique.")
    suite = SuiteSpec(name="lineage", tables=(table,), expectations=(unique,), rows_table="calls")
    calls = pa.table({"call_id": ["c1", "c2", "c2"]})
    site = reports / "lineage" / "run-000"
    run_gx_suite(suite, {"calls": calls}, site_dir=site, run_name="run-000")
    (result,) = (site / "validations").rglob("*.html")
    (reports / "index.html").write_text(
        OVERVIEW.format(index=DOCS_INDEX, result=result.relative_to(reports).as_posix())
    )
    return reports


class Heard(NamedTuple):
    """One request a :class:`Listener` got: its path, its query (unquoted) and its headers."""

    path: str
    query: str
    headers: dict[str, str]


class Beacon(BaseHTTPRequestHandler):
    """Keeps each request (any method) in its server's ``heard``; answers 204: a navigation to it goes nowhere."""

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        self.server.heard.append(Heard(parts.path, unquote(parts.query), dict(self.headers)))
        self.send_response(204)
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


class Listener(ThreadingHTTPServer):
    """An HTTP server on :data:`LISTENER_HOST` that keeps every request it gets: whatever escaped a report."""

    def __init__(self) -> None:
        super().__init__((LISTENER_HOST, 0), Beacon)
        self.heard: list[Heard] = []
        self.url = f"http://{LISTENER_HOST}:{self.server_address[1]}"


@contextlib.contextmanager
def listening() -> Iterator[Listener]:
    """A :class:`Listener` serving in a thread until the block ends."""
    server = Listener()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
