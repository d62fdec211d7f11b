"""Emitting a batch's lineage: one OpenLineage run per task, as Airflow's OpenLineage provider shapes it.

A step reports its datasets through a :class:`LineageSink`: ``with sink.task("finalize", batch) as run:``
does the work, then ``run.report(lambda: finalize_lineage(batch))``. Under Airflow the sink is the
provider's (:mod:`tasks.orchestration.lineage_sink`): the provider emits each task's START and
COMPLETE or FAIL and the report is a RUNNING event with the datasets. Without Airflow,
:class:`EventSink` emits the same events itself: START, RUNNING with the datasets, COMPLETE or
FAIL (with the error), for a job named ``rollout_batch.<task id>`` (the DAG's task ids) whose parent
is the batch's run ``rollout_batch``.

Configuration is the provider's: ``AIRFLOW__OPENLINEAGE__TRANSPORT`` (JSON, the ``[openlineage]``
``transport`` option), or the OpenLineage client's own (``OPENLINEAGE_URL``, ``OPENLINEAGE_CONFIG``,
``OPENLINEAGE__TRANSPORT__*``); ``AIRFLOW__OPENLINEAGE__DISABLED`` or ``OPENLINEAGE_DISABLED``
turns it off. With none set, nothing is emitted. Emission never fails a step: an error building
the datasets or sending an event is logged and counted in :attr:`EventSink.failed`.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from typing import Any, Protocol

from tasks.batch import Batch
from tasks.errors import ConfigError
from tasks.lineage.datasets import TaskLineage
from tasks.lineage.facets import DOCS_URL
from tasks.version import code_version

log = logging.getLogger(__name__)

DAG_ID = "rollout_batch"  # the job name prefix, as the DAG's tasks are named
PRODUCER = DOCS_URL.removesuffix("/blob/main/docs")
DEFAULT_NAMESPACE = "default"  # the provider's default job namespace
_TRUE = ("1", "true", "yes", "on")
_DISABLED = ("AIRFLOW__OPENLINEAGE__DISABLED", "OPENLINEAGE_DISABLED")
_NAMESPACE = ("AIRFLOW__OPENLINEAGE__NAMESPACE", "OPENLINEAGE_NAMESPACE")


class LineageRun(Protocol):
    """One task run: ``report`` builds its datasets (lazily) and emits them; it never raises."""

    def report(self, lineage: Callable[[], TaskLineage]) -> None: ...


class LineageSink(Protocol):
    """Where task runs report their lineage; ``describe`` says what was sent (None: nothing is)."""

    def task(self, task_id: str, batch: Batch) -> AbstractContextManager[LineageRun]: ...

    def describe(self) -> str | None: ...


class _Silent:
    """A run that reports nothing."""

    def report(self, lineage: Callable[[], TaskLineage]) -> None:
        return None


class NoLineage:
    """The sink when lineage is not configured: nothing is built, nothing emitted."""

    @contextmanager
    def task(self, task_id: str, batch: Batch) -> Iterator[LineageRun]:
        yield _Silent()

    def describe(self) -> str | None:
        return None


NO_LINEAGE = NoLineage()


def client_config(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The OpenLineage client's config as ``environ`` sets it: ``{}`` to let the client read its own
    variables, a ``transport`` from ``AIRFLOW__OPENLINEAGE__TRANSPORT``, None when lineage is off.

    A transport that is not a JSON object with a ``type`` raises :class:`ConfigError` naming the variable.
    """
    if any(environ.get(name, "").strip().lower() in _TRUE for name in _DISABLED):
        return None
    text = environ.get("AIRFLOW__OPENLINEAGE__TRANSPORT", "").strip()
    if text:
        try:
            transport = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"AIRFLOW__OPENLINEAGE__TRANSPORT is not JSON: {exc}") from None
        if not isinstance(transport, dict) or "type" not in transport:
            raise ConfigError(f"AIRFLOW__OPENLINEAGE__TRANSPORT must be a JSON object with a type, got {text!r}")
        return {"transport": transport}
    own = ("OPENLINEAGE_URL", "OPENLINEAGE_CONFIG")
    if any(environ.get(name) for name in own) or any(
        k.startswith("OPENLINEAGE__TRANSPORT") and v for k, v in environ.items()
    ):
        return {}
    return None


def sink_from_environment(environ: Mapping[str, str] | None = None) -> EventSink | NoLineage:
    """:class:`EventSink` when ``environ`` (default: this process's) configures a transport, else :data:`NO_LINEAGE`."""
    environ = os.environ if environ is None else environ
    config = client_config(environ)
    if config is None:
        return NO_LINEAGE
    from openlineage.client import OpenLineageClient

    client = OpenLineageClient(config=config) if config else OpenLineageClient()
    namespace = next((environ[name] for name in _NAMESPACE if environ.get(name)), DEFAULT_NAMESPACE)
    return EventSink(client, namespace=namespace)


class EventSink:
    """Emits each task run's events through an OpenLineage client; counts what it sent and what failed."""

    def __init__(self, client: Any, *, namespace: str = DEFAULT_NAMESPACE) -> None:
        self.client = client
        self.namespace = namespace
        self.emitted = 0
        self.failed = 0

    @contextmanager
    def task(self, task_id: str, batch: Batch) -> Iterator[LineageRun]:
        run = _EventRun(self, f"{DAG_ID}.{task_id}", batch)
        run.emit("START")
        try:
            yield run
        except BaseException as exc:
            run.emit("FAIL", error=exc)
            raise
        run.emit("COMPLETE")

    def send(self, event: Any) -> None:
        """Emit one event; a transport error is logged and counted, never raised."""
        try:
            self.client.emit(event)
        except Exception as exc:
            self.failed += 1
            state, job = event.eventType.value, event.job.name
            log.warning("OpenLineage: could not emit the %s event of %s: %s", state, job, exc)
        else:
            self.emitted += 1

    def describe(self) -> str:
        transport = getattr(getattr(self.client, "transport", None), "kind", "?")
        return f"lineage: {self.emitted} OpenLineage event(s) emitted ({transport} transport), {self.failed} failed"


class _EventRun:
    def __init__(self, sink: EventSink, job: str, batch: Batch) -> None:
        self.sink, self.job, self.batch = sink, job, batch
        self.run_id = str(_new_run_id())

    def report(self, lineage: Callable[[], TaskLineage]) -> None:
        try:
            found = lineage()
        except Exception as exc:
            self.sink.failed += 1
            log.warning("OpenLineage: could not describe the datasets of %s: %s", self.job, exc, exc_info=True)
            return
        if found:
            self.emit("RUNNING", lineage=found)

    def emit(self, state: str, *, lineage: TaskLineage | None = None, error: BaseException | None = None) -> None:
        try:
            event = self._event(state, lineage, error)
        except Exception as exc:
            self.sink.failed += 1
            log.warning("OpenLineage: could not build the %s event of %s: %s", state, self.job, exc, exc_info=True)
            return
        self.sink.send(event)

    def _event(self, state: str, lineage: TaskLineage | None, error: BaseException | None) -> Any:
        from openlineage.client.event_v2 import Job, Run, RunEvent, RunState
        from openlineage.client.facet_v2 import error_message_run, job_type_job, parent_run, processing_engine_run

        namespace = self.sink.namespace
        facets: dict[str, Any] = {
            "parent": parent_run.ParentRunFacet(
                run=parent_run.Run(runId=str(batch_run_id(self.batch))),
                job=parent_run.Job(namespace=namespace, name=DAG_ID),
            ),
            "processing_engine": processing_engine_run.ProcessingEngineRunFacet(
                version=code_version().removeprefix("rollout-ledger "), name="rollout-ledger"
            ),
        }
        if error is not None:
            facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
                message=f"{type(error).__name__}: {error}", programmingLanguage="python"
            )
        job_type = job_type_job.JobTypeJobFacet(processingType="BATCH", integration="ROLLOUT_LEDGER", jobType="TASK")
        return RunEvent(
            eventType=RunState[state],
            eventTime=datetime.now(tz=UTC).isoformat(),
            run=Run(runId=self.run_id, facets=facets),
            job=Job(namespace=namespace, name=self.job, facets={"jobType": job_type}),
            inputs=list(lineage.inputs) if lineage else [],
            outputs=list(lineage.outputs) if lineage else [],
            producer=PRODUCER,
        )


def batch_run_id(batch: Batch) -> uuid.UUID:
    """The batch's run: the same id for every task of the batch, whoever runs it."""
    return uuid.uuid5(uuid.NAMESPACE_URL, batch.url)


def _new_run_id() -> uuid.UUID:
    from openlineage.client.uuid import generate_new_uuid

    return generate_new_uuid()
