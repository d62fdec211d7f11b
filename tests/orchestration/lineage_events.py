"""The OpenLineage events a ``dag.test()`` run wrote through the test Airflow's file transport."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from tasks.orchestration import local_airflow


def task_events(dag_run: Any) -> list[dict[str, Any]]:
    """Every task event of ``dag_run``, in the order written (the DAG run's own events left out)."""
    return local_airflow.task_lineage_events(Path(os.environ["AIRFLOW_HOME"]), dag_run.dag_id, dag_run.run_id)


def task_runs(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The events of each task run (mapped tasks: one run per map index), by run id."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        runs[event["run"]["runId"]].append(event)
    return dict(runs)


def reported(events: list[dict[str, Any]], task_id: str) -> list[dict[str, Any]]:
    """The RUNNING events (the datasets each run of ``task_id`` reported)."""
    return [e for e in events if e["eventType"] == "RUNNING" and e["job"]["name"].endswith(f".{task_id}")]
