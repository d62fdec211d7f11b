"""The demo's console: the DAG run's own duration apart from what came before it."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from tasks.orchestration.airflow_demo import Phases, dag_run_seconds


def test_the_dag_run_lasts_from_airflow_s_start_to_its_end():
    start = datetime(2026, 12, 5, 14, 0, tzinfo=UTC)
    assert dag_run_seconds(SimpleNamespace(start_date=start, end_date=start + timedelta(seconds=95.5))) == 95.5
    assert dag_run_seconds(SimpleNamespace(start_date=start, end_date=None)) is None


def test_phases_time_their_blocks_or_up_to_their_end():
    phases = Phases()
    with phases.timed("setup"):
        time.sleep(0.02)
    with phases.timed("server"):
        phases.end("server")
        time.sleep(0.05)  # after the server is up: not the server's time
    assert list(phases.seconds) == ["setup", "server"]
    assert phases.seconds["setup"] >= 0.02 and phases.seconds["server"] < 0.02
    assert phases.total() >= 0.07
