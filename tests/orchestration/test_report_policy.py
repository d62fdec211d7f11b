"""The report viewer's policy: no report file runs a script, what it may load, the headers of every file the viewer
serves, pages that name no asset on another host, and the API server's base path.

Served by Airflow's FastAPI application with this checkout's plugins, over a run whose reports are
real Data Docs (:func:`~tests.orchestration.report_runs.data_docs_batch`), no rollout generated.
"""

from __future__ import annotations

import pytest

from tasks.orchestration.report_viewer import BATCHES_POLICY, REPORT_POLICY, batches_page
from tests.validate.page_assets import external

from .report_runs import data_docs_batch, register_run, sync_dags

pytestmark = [pytest.mark.e2e]
DAG_ID, RUN_ID, BATCH_ID = "rollout_batch", "manual__report-policy", "report-policy-batch"
POLICY = (
    "sandbox allow-same-origin; default-src 'none'; script-src 'none'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'self'"
)


def directives(policy: str) -> dict[str, list[str]]:
    return {name: values for name, *values in (part.split() for part in policy.split(";"))}


def test_a_report_runs_no_script_and_loads_styles_images_and_fonts_from_the_server_alone():
    assert REPORT_POLICY == POLICY
    policy = directives(REPORT_POLICY)
    assert policy["sandbox"] == ["allow-same-origin"]  # no scripts, forms, popups, top navigation, meta refresh
    assert policy["default-src"] == policy["script-src"] == ["'none'"]  # scripts blocked twice; no fetch, frame
    assert policy["form-action"] == policy["base-uri"] == ["'none'"]
    assert policy["frame-ancestors"] == ["'self'"]
    assert set(policy) == {"sandbox", "default-src", "script-src", "style-src", "img-src", "font-src"} | {
        "form-action",
        "base-uri",
        "frame-ancestors",
    }  # connect-src, frame-src, object-src, media-src, worker-src: default-src's 'none'
    for kind in ("style-src", "img-src", "font-src"):
        assert not [source for source in policy[kind] if source not in ("'self'", "'unsafe-inline'", "data:")], kind


def test_the_batches_page_runs_nothing_and_its_links_follow_the_base_path():
    policy = directives(BATCHES_POLICY)
    assert policy["sandbox"] == ["allow-same-origin"]  # no scripts: its links send the session cookie
    assert policy["default-src"] == policy["form-action"] == ["'none'"]
    assert policy["base-uri"] == policy["frame-ancestors"] == ["'self'"]
    assert '<base href="/rollout-ledger/">' in batches_page([])
    for base_path in ("/airflow", "/airflow/"):
        assert '<base href="/airflow/rollout-ledger/">' in batches_page([], base_path=base_path)
    row = {"dag_id": "d", "run_id": "r", "state": "success", "batch_id": "b", "published": True}
    assert '<a href="dags/d/runs/r/reports/">report</a>' in batches_page([row])  # in its own frame: no popup


@pytest.fixture(scope="module")
def client(airflow_db):
    from airflow.api_fastapi.app import create_app
    from fastapi.testclient import TestClient

    return TestClient(create_app())


@pytest.fixture(scope="module")
def admin(client) -> dict[str, str]:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    user = SimpleAuthManagerUser(username="admin", role="admin")
    return {"Authorization": f"Bearer {get_auth_manager().generate_jwt(user)}"}


@pytest.fixture(scope="module")
def reports(airflow_db, tmp_path_factory):
    """The run's ``reports/`` folder on disk, and its address in the viewer."""
    root = tmp_path_factory.mktemp("report-policy")
    folder = data_docs_batch(root, BATCH_ID)
    sync_dags()
    register_run(DAG_ID, RUN_ID, {"batch_id": BATCH_ID, "storage_url": f"file://{root}", "storage_conn_id": None})
    return folder, f"/rollout-ledger/dags/{DAG_ID}/runs/{RUN_ID}/reports/"


def test_every_report_file_carries_the_policy_and_no_page_names_an_asset_on_another_host(client, admin, reports):
    folder, address = reports
    files = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
    assert any(name.endswith(".woff2") for name in files) and sum(name.endswith(".html") for name in files) == 4
    for name in files:
        response = client.get(address + name, headers=admin)
        assert response.status_code == 200, name
        assert response.headers["content-security-policy"] == POLICY, name
        assert response.headers["x-content-type-options"] == "nosniff", name
        assert response.headers["referrer-policy"] == "no-referrer", name
        assert "access-control-allow-origin" not in response.headers, name  # fonts too: read from their own origin
        if name.endswith((".html", ".css")) and "/static/vendor/" not in name:
            assert not external(response.text), name


def test_errors_and_redirects_carry_the_headers_and_redirects_stay_below_the_base_path(client, admin, reports):
    _, address = reports
    for response in (
        client.get(address + "missing.html", headers=admin),
        client.get(address + "index.html"),  # 401: no session
        client.get(address.rstrip("/"), headers=admin, follow_redirects=False),
    ):
        assert response.headers["content-security-policy"] == POLICY
        assert response.headers["referrer-policy"] == "no-referrer"
    root = client.get(address.rstrip("/"), headers=admin, follow_redirects=False)
    assert (root.status_code, root.headers["location"]) == (307, "reports/")  # relative: no base path to know


def test_the_batches_page_base_href_is_the_api_servers_base_path(client, admin, monkeypatch):
    page = client.get("/rollout-ledger/batches", headers=admin)
    assert page.headers["content-security-policy"] == BATCHES_POLICY
    assert '<base href="/rollout-ledger/">' in page.text and page.headers["referrer-policy"] == "no-referrer"
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example/team/airflow/")
    assert '<base href="/team/airflow/rollout-ledger/">' in client.get("/rollout-ledger/batches", headers=admin).text
