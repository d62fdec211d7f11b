"""The validation report viewer: a FastAPI app the Airflow api-server mounts at ``/rollout-ledger``.

Routes, every one behind Airflow's own authentication:

* ``GET /dags/{dag_id}/runs/{run_id}/reports/`` — the run's overview page (``reports/index.html``);
* ``GET /dags/{dag_id}/runs/{run_id}/reports/{path}`` — any file below the batch's ``reports/``
  (Data Docs pages, their styles, images and fonts), with its content type;
* ``GET /batches`` — the recent batches the user may read: run, state, published or not, links.

Invariant: no report file runs a script, and every one is read through Airflow's session. Storage
contents are untrusted (whoever can write a batch's storage can put any HTML in ``reports/``), so
every file is served with :data:`REPORT_POLICY`: a sandbox without ``allow-scripts`` and
``script-src 'none'`` (scripts blocked twice, inline handlers and ``javascript:`` URLs included),
no form, window, top navigation or ``<meta>`` refresh (the sandbox), nothing loaded but style
sheets, images and fonts from the api-server itself (``default-src 'none'``), no ``<base>``, and
no framing but by Airflow's own pages. With no script to run, the sandbox keeps Airflow's origin
(``allow-same-origin``): a page's own loads and the links followed in the UI's frame carry the
reader's session cookie (``SameSite=Lax``), so each request is authenticated and authorized again
and an address of a report reads nothing without a session. GX's Data Docs are shown without their
scripts (docs/validation.md says what that loses; their assets are vendored: :mod:`tasks.validate.data_docs`).

A run maps to its batch through what its ``plan`` task recorded (XCom ``batch``: batch id,
storage URL, connection id); files are read through ``ObjectStoragePath`` with that connection.
Report routes require read access to the DAG's runs (``requires_access_dag``: the bearer token or
the UI's ``_token`` cookie): 401 without a token, 403 without access. Ids outside their charsets and
paths that are not plain relative paths (``..``, ``.``, absolute, encoded, backslashes, hidden
names) are 404 before any storage is touched; nothing outside ``reports/`` can be named.

Every response carries ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: no-referrer`` and
:data:`REPORT_POLICY`, but the batches page, which is the viewer's own: everything it interpolates
is HTML-escaped, its ``<base href>`` follows the API server's base path (``[api] base_url``), and
its policy (:data:`BATCHES_POLICY`) is the same sandbox, its one style sheet allowed by hash.

No ``from __future__ import annotations`` here: FastAPI resolves the routes' parameter types
(``SessionDep``, ``GetUserDep``, imported inside :func:`create_app`) when they are declared.
"""

import base64
import hashlib
import html
import mimetypes
import re
from typing import Any
from urllib.parse import quote, urlsplit

from tasks.orchestration.batch_xcom import BATCH_XCOM_KEY, PLAN_TASK_ID

URL_PREFIX = "/rollout-ledger"  # where the api-server mounts the app (plugins/report_viewer.py)
DAG_ID = re.compile(r"[A-Za-z0-9_.-]{1,250}")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:+-]{0,249}")
PATH_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")  # no leading dot: no '.', '..' or hidden names
# The sandbox: no scripts, forms, popups, top navigation or automatic features (<meta> refresh); same origin kept,
# so a page's loads and links carry the session cookie. default-src 'none': no fetch, frame, object, media or worker.
# Styles inline (Data Docs are made of them) or from the server, images and fonts from the server; no page sets a base.
REPORT_POLICY = (
    "sandbox allow-same-origin; default-src 'none'; script-src 'none'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'self'"
)
RECENT_BATCHES = 50
BATCHES_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #1d2433; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .4rem .6rem; border-bottom: 1px solid #d8dde6; font-size: .9rem; }
th { background: #f3f5f9; }
"""
# The report policy's sandbox, its one style sheet allowed by hash; its <base href> names the API server's base path.
BATCHES_POLICY = (
    "sandbox allow-same-origin; default-src 'none'; "
    f"style-src 'sha256-{base64.b64encode(hashlib.sha256(BATCHES_STYLE.encode()).digest()).decode()}'; "
    "form-action 'none'; base-uri 'self'; frame-ancestors 'self'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": REPORT_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
FILE_HEADERS = {"Cache-Control": "private, no-cache"}  # a report is the reader's: no shared cache keeps it


class NotFoundError(LookupError):
    """What the request names does not exist or may not be named (answered 404)."""


def api_base_path() -> str:
    """The path of the API server's ``[api] base_url``, without its trailing slash (``""`` at the root)."""
    from airflow.configuration import conf

    return urlsplit(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")


def run_report_path(dag_id: str, run_id: str, *, base_path: str = "") -> str:
    """The URL path of a run's overview page; ``base_path`` is the api-server's own (``[api] base_url``'s path)."""
    return f"{base_path.rstrip('/')}{URL_PREFIX}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe=':+')}/reports/"


def report_path(path: str) -> list[str]:
    """The segments of a relative path below ``reports/``, or :class:`NotFoundError`."""
    segments = path.split("/")
    if not path or not all(PATH_SEGMENT.fullmatch(segment) for segment in segments):
        raise NotFoundError(path)
    return segments


def check_run(dag_id: str, run_id: str) -> None:
    if not DAG_ID.fullmatch(dag_id) or not RUN_ID.fullmatch(run_id):
        raise NotFoundError(f"{dag_id}/{run_id}")


def read_batch_record(session: Any, dag_id: str, run_id: str) -> dict[str, Any]:
    """What the run's plan task recorded about its batch, or :class:`NotFoundError`."""
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    row = session.scalars(
        select(XComModel).where(
            XComModel.dag_id == dag_id,
            XComModel.run_id == run_id,
            XComModel.task_id == PLAN_TASK_ID,
            XComModel.key == BATCH_XCOM_KEY,
            XComModel.map_index == -1,
        )
    ).first()
    if row is None:
        raise NotFoundError(f"run {run_id} of {dag_id} has no planned batch")
    record = XComModel.deserialize_value(row)
    if not isinstance(record, dict) or not {"batch_id", "storage_url"} <= set(record):
        raise NotFoundError(f"run {run_id} of {dag_id}: unreadable batch record")
    return record


def reports_dir(record: dict[str, Any]) -> Any:
    """The batch's ``reports/`` as an ``ObjectStoragePath`` carrying the run's connection."""
    from airflow.sdk import ObjectStoragePath

    from tasks.ids import check_id

    batch_id = check_id(record["batch_id"], field="batch_id")
    base = ObjectStoragePath(record["storage_url"], conn_id=record.get("storage_conn_id") or None)
    return base / "batches" / batch_id / "reports"


def read_report(record: dict[str, Any], segments: list[str]) -> tuple[bytes, str]:
    """The file's bytes and content type, or :class:`NotFoundError`."""
    target = reports_dir(record).joinpath(*segments)
    try:
        data = target.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise NotFoundError("/".join(segments)) from None
    kind, _ = mimetypes.guess_type(segments[-1])
    kind = kind or "application/octet-stream"
    if kind.startswith("text/") or kind in ("application/json", "image/svg+xml"):
        kind += "; charset=utf-8"
    return data, kind


def batches_page(rows: list[dict[str, Any]], *, base_path: str = "") -> str:
    """The batches page: one table row per run, every value escaped; links resolve below ``base_path``."""

    def cell(value: Any) -> str:
        return f"<td>{html.escape(str(value))}</td>"

    body = []
    for row in rows:
        link = f"dags/{row['dag_id']}/runs/{row['run_id']}/reports/"
        report = f'<a href="{html.escape(link, quote=True)}">report</a>'
        body.append(
            "<tr>"
            + cell(row["dag_id"])
            + cell(row["run_id"])
            + cell(row["state"])
            + cell(row["batch_id"])
            + cell("published" if row["published"] else "not published")
            + f"<td>{report}</td></tr>"
        )
    table = "\n".join(body) or '<tr><td colspan="6">No batches yet: trigger the rollout_batch DAG.</td></tr>'
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Rollout batches</title>
<base href="{html.escape(base_path.rstrip("/") + URL_PREFIX, quote=True)}/">
<style>{BATCHES_STYLE}</style></head><body>
<h1>Rollout batches</h1>
<p>The {RECENT_BATCHES} most recent runs that planned a batch, in the DAGs you can read.</p>
<table><thead><tr><th>DAG</th><th>run</th><th>state</th><th>batch</th><th>dataset</th><th></th></tr></thead>
<tbody>
{table}
</tbody></table></body></html>
"""


def recent_batches(session: Any, dag_ids: set[str]) -> list[dict[str, Any]]:
    """The most recent runs of ``dag_ids`` whose plan recorded a batch, newest first, with published flags."""
    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    query = (
        select(XComModel, DagRun.state)
        .join(DagRun, DagRun.id == XComModel.dag_run_id)
        .where(XComModel.task_id == PLAN_TASK_ID, XComModel.key == BATCH_XCOM_KEY, XComModel.dag_id.in_(dag_ids))
        .order_by(DagRun.id.desc())
        .limit(RECENT_BATCHES)
    )
    rows = []
    for xcom, state in session.execute(query):
        record = XComModel.deserialize_value(xcom)
        rows.append(
            {
                "dag_id": xcom.dag_id,
                "run_id": xcom.run_id,
                "state": state,
                "batch_id": record.get("batch_id", "?"),
                "published": _published(record),
            }
        )
    return rows


def _published(record: dict[str, Any]) -> bool:
    from tasks import layout

    try:
        return (reports_dir(record).parent / layout.DATASET_MARKER).exists()
    except Exception:  # a batch whose storage is gone or unreachable is listed as not published
        return False


def create_app() -> Any:
    """The FastAPI app; every route depends on Airflow's authentication, the report routes on its access checks too."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.common.db.common import SessionDep
    from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag
    from fastapi import Depends, FastAPI, Request, Response
    from fastapi.responses import HTMLResponse, RedirectResponse

    app = FastAPI(title="rollout-ledger reports", docs_url=None, redoc_url=None, openapi_url=None)
    read_runs = [Depends(requires_access_dag("GET", DagAccessEntity.RUN))]

    @app.middleware("http")
    async def security_headers(request: Request, call_next: Any) -> Response:
        """Every response gets the headers; one that names its own policy (the batches page) keeps it."""
        response = await call_next(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    @app.exception_handler(NotFoundError)
    async def not_found(request: Request, exc: NotFoundError) -> Response:
        return Response("Not Found", status_code=404, media_type="text/plain", headers=SECURITY_HEADERS)

    def report_file_response(session: Any, dag_id: str, run_id: str, path: str) -> Response:
        """The file ``path`` below the run's ``reports/``; ids and path are checked before the run's record is read."""
        check_run(dag_id, run_id)
        segments = report_path(path)
        data, kind = read_report(read_batch_record(session, dag_id, run_id), segments)
        return Response(data, media_type=kind, headers=FILE_HEADERS)

    @app.get("/dags/{dag_id}/runs/{run_id}/reports", dependencies=read_runs, include_in_schema=False)
    def reports_root(dag_id: str, run_id: str) -> Response:
        check_run(dag_id, run_id)
        return RedirectResponse("reports/", status_code=307)  # relative: the API server's base path kept

    @app.get("/dags/{dag_id}/runs/{run_id}/reports/", dependencies=read_runs)
    def report_index(dag_id: str, run_id: str, session: SessionDep) -> Response:
        return report_file_response(session, dag_id, run_id, "index.html")

    @app.get("/dags/{dag_id}/runs/{run_id}/reports/{path:path}", dependencies=read_runs)
    def report_file(dag_id: str, run_id: str, path: str, session: SessionDep) -> Response:
        return report_file_response(session, dag_id, run_id, path)

    @app.get("/batches", response_class=HTMLResponse)
    def batches(user: GetUserDep, session: SessionDep) -> HTMLResponse:
        from airflow.api_fastapi.app import get_auth_manager

        readable = get_auth_manager().get_authorized_dag_ids(user=user, method="GET", session=session)
        return HTMLResponse(
            batches_page(recent_batches(session, readable), base_path=api_base_path()),
            headers={"Content-Security-Policy": BATCHES_POLICY},
        )

    return app
