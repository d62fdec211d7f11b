"""The report viewer mounted on Airflow's own api-server app: authentication, access, traversal, headers, content.

Over a real published run (the session's ``published_run``) and Airflow's FastAPI application
with this checkout's plugins, as the api-server serves it. Tokens are Airflow's own JWTs for
simple-auth-manager users: an admin, a viewer, and a user with no role (no DAG access: 403).
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

import pytest

from tasks.orchestration.report_viewer import REPORT_POLICY, batches_page

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SVG_WITH_SCRIPT = "<svg xmlns='http://www.w3.org/2000/svg'><script>document.title = 'ran'</script></svg>"


@pytest.fixture(scope="module")
def client(airflow_db):
    from airflow.api_fastapi.app import create_app
    from fastapi.testclient import TestClient

    return TestClient(create_app())


def token(role: str | None, name: str) -> str:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=name, role=role))


@pytest.fixture(scope="module")
def headers(client):
    return {
        "admin": {"Authorization": f"Bearer {token('admin', 'admin')}"},
        "viewer": {"Authorization": f"Bearer {token('viewer', 'viewer')}"},
        "nobody": {"Authorization": f"Bearer {token(None, 'nobody')}"},
    }


@pytest.fixture(scope="module")
def reports(published_run):
    dag_run, _ = published_run
    return f"/rollout-ledger/dags/{dag_run.dag_id}/runs/{dag_run.run_id}/reports/"


def test_the_overview_page_and_data_docs_are_served_with_their_types_and_headers(
    client, headers, reports, published_run
):
    from tasks.orchestration.steps import run_batch_id

    dag_run, conf = published_run
    page = client.get(reports, headers=headers["viewer"])
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert run_batch_id(conf, dag_run) in page.text and "<svg" in page.text
    assert page.headers["content-security-policy"] == REPORT_POLICY
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    for path, kind in [
        ("lineage/run-000/index.html", "text/html; charset=utf-8"),
        ("dataset/run-000/summary.json", "application/json; charset=utf-8"),
        ("lineage/run-000/static/styles/data_docs_default_styles.css", "text/css; charset=utf-8"),
        ("lineage/run-000/static/images/favicon.ico", "image/vnd.microsoft.icon"),
        ("lineage/run-000/static/vendor/bootstrap/bootstrap.min.css", "text/css; charset=utf-8"),
        ("lineage/run-000/static/vendor/jquery/jquery.min.js", "text/javascript; charset=utf-8"),
    ]:
        response = client.get(reports + path, headers=headers["admin"])
        assert (response.status_code, response.headers["content-type"]) == (200, kind), path
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["content-security-policy"] == REPORT_POLICY, path


def test_every_report_file_is_sandboxed_whatever_its_type(client, headers, reports, published_run):
    """An SVG or HTML file below reports/ other than the overview page gets the same policy: its script never runs."""
    from tasks.orchestration.steps import run_batch_id

    dag_run, conf = published_run
    folder = Path(conf["storage_url"].removeprefix("file://")) / "batches" / run_batch_id(conf, dag_run) / "reports"
    for name, text, kind in [
        ("sandbox-check.svg", SVG_WITH_SCRIPT, "image/svg+xml; charset=utf-8"),
        ("sandbox-check.html", f"<!doctype html>{SVG_WITH_SCRIPT}", "text/html; charset=utf-8"),
    ]:
        (folder / name).write_text(text)
        response = client.get(reports + name, headers=headers["viewer"])
        assert (response.status_code, response.headers["content-type"], response.text) == (200, kind, text)
        assert response.headers["content-security-policy"] == REPORT_POLICY


def test_each_file_is_served_at_its_own_address_to_the_session_that_asks(client, headers, reports):
    """No redirect and no grant: the page and the files it names are each read with the session, and not without."""
    from urllib.parse import urljoin

    cookie = {"Cookie": f"_token={token('viewer', 'viewer')}"}  # the UI keeps its token in this cookie
    page = client.get(reports, headers=cookie, follow_redirects=False)
    assert page.status_code == 200 and "<svg" in page.text and "location" not in page.headers
    docs = f"{reports}lineage/run-000/index.html"
    style = urljoin(docs, "static/styles/data_docs_default_styles.css")  # as the page names it: relative
    for address in (docs, style):
        assert client.get(address, headers=cookie, follow_redirects=False).status_code == 200, address
        assert client.get(address, follow_redirects=False).status_code == 401, address  # the address alone: nothing


@pytest.mark.parametrize("route", ["", "lineage/run-000/index.html"])
def test_no_token_is_401_and_no_access_is_403(client, headers, reports, route):
    assert client.get(reports + route).status_code == 401
    assert client.get(reports + route, headers=headers["nobody"]).status_code == 403
    # Airflow answers a token it cannot verify with 403 ("Invalid JWT token"), before any route code runs
    assert client.get(reports + route, headers={"Authorization": "Bearer forged"}).status_code == 403


def test_the_batches_page_needs_a_login_and_lists_the_run(client, headers, published_run):
    dag_run, _ = published_run
    assert client.get("/rollout-ledger/batches").status_code == 401
    page = client.get("/rollout-ledger/batches", headers=headers["viewer"])
    assert page.status_code == 200 and dag_run.run_id.replace("+", "+") in page.text
    assert "published" in page.text and f"dags/rollout_batch/runs/{dag_run.run_id}/reports/" in page.text
    (style,) = re.findall(r"<style>(.*?)</style>", page.text, re.S)
    digest = base64.b64encode(hashlib.sha256(style.encode()).digest()).decode()
    assert page.headers["content-security-policy"] == (  # sandboxed too, without scripts: it has none
        f"sandbox allow-same-origin; default-src 'none'; style-src 'sha256-{digest}'; form-action 'none'; "
        "base-uri 'self'; frame-ancestors 'self'"
    )
    nobody = client.get("/rollout-ledger/batches", headers=headers["nobody"])
    assert nobody.status_code == 200 and dag_run.run_id not in nobody.text  # it lists only readable DAGs


@pytest.mark.parametrize(
    "path",
    [
        "../plan/batch.json",
        "..%2fplan%2fbatch.json",
        "%2e%2e/plan/batch.json",
        "%2e%2e%2fdataset%2f_COMMITTED.json",
        "%252e%252e/plan/batch.json",
        "lineage/run-000/../../../plan/batch.json",
        "lineage/%2e/run-000/index.html",
        "/etc/passwd",
        "%2fetc%2fpasswd",
        "lineage%5c..%5c..%5cplan",
        ".hidden",
        "lineage//run-000/index.html",
        "lineage/run-000/missing.html",
        "index.html%00.png",
    ],
)
def test_paths_that_leave_reports_or_are_not_plain_are_404(client, headers, reports, path):
    response = client.get(reports + path, headers=headers["admin"])
    assert response.status_code == 404, path
    assert response.headers["content-security-policy"] == REPORT_POLICY


@pytest.mark.parametrize(
    ("dag_id", "run_id"),
    [
        ("rollout_batch", "no-such-run"),
        ("no_such_dag", "manual__x"),
        ("bad%20dag", "r"),
        ("rollout_batch", "%3Cscript%3E"),
    ],
)
def test_unknown_runs_and_ids_outside_the_charset_are_404(client, headers, dag_id, run_id):
    response = client.get(f"/rollout-ledger/dags/{dag_id}/runs/{run_id}/reports/", headers=headers["admin"])
    assert response.status_code == 404


def test_everything_the_batches_page_interpolates_is_escaped():
    page = batches_page(
        [
            {
                "dag_id": "d",
                "run_id": 'r"><script>alert(1)</script>',
                "state": "<b>x</b>",
                "batch_id": "b&c",
                "published": False,
            }
        ]
    )
    assert "<script>" not in page and "<b>x</b>" not in page
    assert "&lt;script&gt;" in page and "&lt;b&gt;x&lt;/b&gt;" in page and "b&amp;c" in page
    assert 'href="dags/d/runs/r&quot;&gt;&lt;script&gt;' in page
