"""The ``review`` task of ``rollout_batch``: a person decides whether a batch that validation warned about is published.

An Airflow 3.3 human-in-the-loop task (the standard provider's ``HITLOperator``). It skips
itself when both suites passed and the run does not require review (``require_review``), and
follows a decision recorded before (``rollout-ledger publish --approve/--reject``, an earlier
try). Otherwise it writes its request — the form of :mod:`tasks.orchestration.review_form`:
buttons Publish / Reject and a reason — and waits in ``awaiting_input``, holding no worker and
no pool slot, until someone answers in the UI or through the REST API
(``PATCH .../taskInstances/review/-1/hitlDetails``). The answer is recorded through the same
function as the CLI's (:func:`tasks.orchestration.steps.decide`). A rejection fails the task
without retry, so publish never runs and the run fails; so does a review nobody answers within
``review_timeout_hours`` (Airflow's scheduler resumes it), which is recorded as a rejection with
reason ``review_timeout``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.providers.standard.operators.hitl import HITLOperator
from airflow.sdk import Param

from tasks.orchestration import steps
from tasks.orchestration.form import DEFAULT_REVIEW_TIMEOUT_HOURS
from tasks.records.review import OPTIONS, REASON_FIELD, REASON_SCHEMA


class BatchReviewOperator(HITLOperator):
    """Waits for Publish or Reject (with a reason) on the run's batch; see the module docstring."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.pop("params", None)  # the DAG's params, merged in by Airflow; the form's one field is the reason
        super().__init__(
            subject="Review the batch before it is published",
            options=list(OPTIONS),
            params={REASON_FIELD: Param(**REASON_SCHEMA)},
            response_timeout=dt.timedelta(hours=DEFAULT_REVIEW_TIMEOUT_HOURS),  # execute sets the run's
            **kwargs,
        )

    def execute(self, context: Any) -> Any:
        from airflow.sdk.exceptions import AirflowSkipException

        params, run = context["params"], context["dag_run"]
        request = steps.review_request(params, run)
        if request.decision is not None:
            self.log.info("batch %s was decided before: %s", request.batch_id, request.decision.describe())
            return steps.follow_decision(params, run, request.decision)
        if request.published:
            raise AirflowSkipException(f"batch {request.batch_id} is already published")
        if not request.needed:
            raise AirflowSkipException("both suites passed and the run does not require review")
        self.subject, self.body = request.subject, request.body
        self.response_timeout = dt.timedelta(hours=params["review_timeout_hours"])
        self.log.info(
            "batch %s waits for a decision (%s); no answer within %s rejects it",
            request.batch_id,
            "; ".join(request.needed),
            self.response_timeout,
        )
        return super().execute(context)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        params, run = context["params"], context["dag_run"]
        if event.get("error_type") == "timeout":
            return steps.review_timed_out(params, run)
        if "error" in event:
            return super().execute_complete(context, event)  # raises the provider's error
        return steps.decide(params, run, steps.response_decision(params, run, event))
