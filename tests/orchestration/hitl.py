"""Answering the ``review`` task while ``dag.test()`` runs it in the test's main thread.

``dag.test()`` leaves a human-in-the-loop task in ``awaiting_input`` until something outside it
answers, as in a deployment: here a background thread, through Airflow's REST API on the
session's api-server (:func:`answer_review`), the browser, or the scheduler's own timeout sweep
(:func:`sweep_timeouts`). :class:`InBackground` runs such a thread; if it fails, it fails every
task still awaiting input, so ``dag.test()`` returns instead of waiting for good.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tasks.orchestration import local_airflow

DAG_ID, TASK_ID = "rollout_batch", "review"


class AirflowRest:
    """Airflow's public REST API as the local login (a bearer token from ``/auth/token``)."""

    def __init__(self, url: str) -> None:
        import httpx

        user, password = local_airflow.LOGIN
        self.client = httpx.Client(base_url=url, timeout=30)
        response = self.client.post("/auth/token", json={"username": user, "password": password})
        response.raise_for_status()
        self.client.headers["Authorization"] = f"Bearer {response.json()['access_token']}"

    def pending_reviews(self) -> list[dict[str, Any]]:
        """The review requests nobody has answered, with their task instances."""
        response = self.client.get(
            f"/api/v2/dags/{DAG_ID}/dagRuns/~/hitlDetails", params={"task_id": TASK_ID, "response_received": "false"}
        )
        response.raise_for_status()
        return list(response.json()["hitl_details"])

    def answer(self, run_id: str, option: str, reason: str) -> dict[str, Any]:
        """``PATCH .../taskInstances/review/-1/hitlDetails``: what a person's click on a button sends."""
        response = self.client.patch(
            f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{TASK_ID}/-1/hitlDetails",
            json={"chosen_options": [option], "params_input": {"reason": reason}},
        )
        response.raise_for_status()
        return response.json()


def wait_for_review(rest: AirflowRest, stop: threading.Event) -> dict[str, Any]:
    """The one pending review request, once a run's review task waits for input (LookupError if the run ends first).

    The request is listed a moment before its task leaves ``running`` for ``awaiting_input``: it counts from then.
    """
    while not stop.wait(1.0):
        pending = rest.pending_reviews()
        if pending:
            assert len(pending) == 1, f"expected one pending review, got {pending}"
            if pending[0]["task_instance"]["state"] == "awaiting_input":
                return pending[0]
    raise LookupError("the run ended without a review task waiting for input")


def answer_review(rest: AirflowRest, option: str, reason: str, stop: threading.Event) -> dict[str, Any]:
    """Wait for the review request, then answer it; returns the request as the API showed it before the answer."""
    request = wait_for_review(rest, stop)
    rest.answer(request["task_instance"]["dag_run_id"], option, reason)
    return request


def sweep_timeouts(stop: threading.Event) -> int:
    """What Airflow's scheduler does every ``trigger_timeout_check_interval``: resume reviews past their deadline.

    Runs the scheduler's own sweep every second until ``stop``; returns how many sweeps ran.
    """
    from airflow.jobs.job import Job
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner

    runner = SchedulerJobRunner(job=Job())
    sweeps = 0
    while not stop.wait(1.0):
        runner.check_awaiting_input_timeouts()
        sweeps += 1
    return sweeps


def fail_awaiting_tasks() -> None:
    """Fail every task instance awaiting input, so a ``dag.test()`` waiting on one returns."""
    from airflow import settings
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.state import TaskInstanceState

    with settings.Session() as session:
        for ti in session.query(TaskInstance).filter(TaskInstance.state == TaskInstanceState.AWAITING_INPUT):
            ti.state = TaskInstanceState.FAILED
        session.commit()


class InBackground:
    """``target(stop)`` in a thread, ``stop`` set by :meth:`result` once the run is over.

    A failure of ``target`` fails the tasks awaiting input (the run must not wait for an answer
    that never comes), and :meth:`result` re-raises it.
    """

    def __init__(self, target: Callable[[threading.Event], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(target,), daemon=True)
        self._thread.start()

    def _run(self, target: Callable[[threading.Event], Any]) -> None:
        try:
            self._value = target(self._stop)
        except BaseException as exc:
            self._error = exc
            fail_awaiting_tasks()

    def result(self, timeout: float = 60.0) -> Any:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the background answer did not finish")
        if self._error is not None:
            raise self._error
        return self._value
