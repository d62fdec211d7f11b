"""Airflow plugin: the validation report viewer (``tasks.orchestration.report_viewer``) in the Airflow UI.

Mounts the viewer's FastAPI app on the api-server at ``/rollout-ledger``, adds a "Validation
report" entry to every DAG run's page (rendered inside the UI) and a "Rollout batches" page
to the navigation. Their addresses are relative: the UI resolves them against its ``<base href>``,
the API server's base path (``[api] base_url``), where the app is mounted.
"""

from __future__ import annotations

from typing import ClassVar

from airflow.plugins_manager import AirflowPlugin

from tasks.orchestration.report_viewer import URL_PREFIX, create_app


class RolloutLedgerReports(AirflowPlugin):
    name = "rollout_ledger_reports"
    fastapi_apps: ClassVar[list[dict]] = [
        {"app": create_app(), "url_prefix": URL_PREFIX, "name": "rollout-ledger reports"}
    ]
    external_views: ClassVar[list[dict]] = [
        {
            "name": "Validation report",
            "href": URL_PREFIX.lstrip("/") + "/dags/{DAG_ID}/runs/{RUN_ID}/reports/",
            "destination": "dag_run",
            "url_route": "validation-report",
        },
        {
            "name": "Rollout batches",
            "href": URL_PREFIX.lstrip("/") + "/batches",
            "destination": "nav",
            "url_route": "rollout-batches",
            "category": "browse",
        },
    ]
