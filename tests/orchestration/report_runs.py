"""Helpers of the report viewer's tests: DAG runs whose plan task recorded a batch, and a batch of Data Docs alone.

:class:`Listener` is a loopback server that keeps every request it gets: what escaped a report.
A run needs only its DAG in the metadata DB (:func:`sync_dags`, or a session's ``published_run``);
the viewer reads nothing of a batch but its ``reports/``, so :func:`data_docs_batch` writes that
folder alone: one real Data Docs site built by :func:`~tasks.validate.gx_run.run_gx_suite` (vendored
assets included) and a small overview page linking it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pyarrow as pa

from tasks.orchestration.batch_xcom import BATCH_XCOM_KEY, PLAN_TASK_ID

DOCS_INDEX = "lineage/run-000/index.html"
OVERVIEW = f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>overview</title></head>
<body><h1>Batch overview</h1><p><a href="{DOCS_INDEX}">lineage Data Docs</a></p></body></html>
"""


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
    run_gx_suite(suite, {"calls": calls}, site_dir=reports / "lineage" / "run-000", run_name="run-000")
    (reports / "index.html").write_text(OVERVIEW)
    return reports


class Beacon(BaseHTTPRequestHandler):
    """Keeps the path and query of each request (any method) in its server's ``heard``; answers 204."""

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        self.server.heard.append((parts.path, unquote(parts.query)))
        self.send_response(204)
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


class Listener(ThreadingHTTPServer):
    """A loopback HTTP server that keeps every request it gets (path, query): whatever escaped a report."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Beacon)
        self.heard: list[tuple[str, str]] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


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
