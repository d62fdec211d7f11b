"""kill -9 of the generate task of `rollout_batch` runs at seeded crash points; Airflow's retry finishes the batch.

The generate task's work runs in its child process (``tasks.orchestration.generate_process``),
which inherits the crash point from the task's environment and kills itself with SIGKILL there;
it calls the test run's vLLM server (engine ``vllm_server``), as the clean reference run does.
Airflow sees the task fail, retries it (a new attempt that adopts what the killed one completed),
and the run goes on through the suites, finalize, publish and the sweep. A watcher snapshots the
killed attempt's objects the moment its process is gone, before the retry starts, for
:func:`crash_trials.check_survivors`. The default run has one trial; ``make crash-trials`` runs five.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from pathlib import Path

import psutil
import pytest

import tasks.crash_points  # noqa: F401  (imported, so read, before the variable is set: only generate's child crashes)
from tasks.batch import Batch
from tasks.crash_points import CRASH_AT_VARIABLE
from tasks.engines.vllm_server.options import API_KEY_ENV
from tasks.orchestration import local_airflow
from tasks.storage.claims import read_claims
from tasks.storage.objects import ObjectStore
from tests.reliability.crash_trials import (
    Trial,
    check_survivors,
    first_attempt_objects,
    killed_attempt_calls,
    reference_rows,
    trial_count,
)

from .conftest import SERVERS_FIELDS, server_connection

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.crash_trials]
TRIALS = trial_count("CRASH_TRIALS_DAG", 1)
# The plan of the CLI trials' guess_number kind (tests/reliability/test_crash_trials.py): one clean run serves both.
CONF = {
    "num_tasks": 4,
    "group_size": 2,
    "shards": 1,
    "max_turns": 3,
    "max_tokens": 16,
    "temperature": 0.8,
    "environment_options": {"lo": 1, "hi": 8},
    "max_in_flight": 4,
}


class KilledAttemptSnapshot(threading.Thread):
    """Waits for the crash point's file, then for the process it names to be gone, then snapshots attempt 0."""

    def __init__(self, once: Path, store: ObjectStore) -> None:
        super().__init__(daemon=True)
        self.once, self.store, self.objects, self.calls = once, store, None, 0

    def run(self) -> None:
        while not self.once.exists():
            time.sleep(0.05)
        pid = int(self.once.read_text().rsplit(" pid ", 1)[1])
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.02)
        self.objects = first_attempt_objects(self.store)
        self.calls = killed_attempt_calls(self.store)


@pytest.mark.parametrize("seed", range(100, 100 + TRIALS))
def test_a_generate_task_killed_at_a_crash_point_is_retried_by_airflow_and_the_batch_loses_nothing(
    seed, airflow_db, vllm_server, tmp_path, monkeypatch
):
    rollout_batch = local_airflow.dag_bag("rollout_batch.py").dags["rollout_batch"]
    rollout_batch.get_task("generate").partial_kwargs["retry_delay"] = dt.timedelta(seconds=1)
    trial = Trial.of_seed(seed, tmp_path / "crashed", kinds=("guess_number",))  # the conf's environment
    print(trial)
    monkeypatch.setenv("PYTHONPATH", str(local_airflow.CHECKOUT))
    monkeypatch.setenv(CRASH_AT_VARIABLE, trial.crash.to_json())
    root = str(tmp_path / "runs")
    monkeypatch.setenv(*server_connection(vllm_server))
    conf = {**CONF, **SERVERS_FIELDS, "batch_id": f"dag-crash-{seed}", "storage_url": f"file://{root}"}
    store = Batch.open(root, conf["batch_id"]).store
    snapshot = KilledAttemptSnapshot(tmp_path / "crashed", store)
    snapshot.start()

    dag_run = rollout_batch.test(run_conf=conf)

    snapshot.join(timeout=30)
    assert snapshot.objects is not None, f"{trial}: the generate task was never killed at its crash point"
    states = {(ti.task_id, ti.map_index): (str(ti.state), ti.try_number) for ti in dag_run.get_task_instances()}
    assert {state for state, _ in states.values()} <= {"success", "skipped"}, f"{trial}: {states}"
    assert states[("publish", -1)][0] == "success", f"{trial}: {states}"
    assert states[("generate", 0)][1] == 2, f"{trial}: Airflow did not retry the killed generate task once"
    assert [c.try_number for c in read_claims(store, 0)][-1] == 2
    batch = Batch.open(root, conf["batch_id"])
    monkeypatch.setenv(API_KEY_ENV, vllm_server.key)  # the clean run's key, as the run's connection gave it
    clean_run = reference_rows(str(tmp_path / "clean"), batch.config)
    check_survivors(batch, snapshot.objects, clean_run, snapshot.calls)
