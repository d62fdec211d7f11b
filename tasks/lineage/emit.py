"""Emitting a batch's lineage: one OpenLineage run per task, as Airflow's OpenLineage provider shapes it.

A step reports its datasets through a :class:`LineageSink`: ``with sink.task("finalize", batch) as run:``
does the work, then ``run.report(lambda: finalize_lineage(batch))``. Under Airflow no sink is used:
the provider emits each task's START and COMPLETE or FAIL, and the task adds a RUNNING event with
the same datasets (:func:`tasks.orchestration.lineage_report.report_lineage`). Without Airflow,
:class:`EventSink` emits the same events itself: START, RUNNING with the datasets, COMPLETE or
FAIL (with the error), for a job named ``rollout_batch.<task id>`` (the DAG's task ids) whose parent
is the batch's run ``rollout_batch``.

Configuration is the OpenLineage client's own (``OpenLineageClient()`` resolves it: ``OPENLINEAGE_DISABLED``,
``OPENLINEAGE_CONFIG`` or an ``openlineage.yml`` in the working directory or ``~/.openlineage``,
``OPENLINEAGE__*`` variables, ``OPENLINEAGE_URL``), plus the settings of Airflow's provider a
deployment already has: ``AIRFLOW__OPENLINEAGE__TRANSPORT`` (JSON, the ``[openlineage]``
``transport`` option), handed to the client as its transport, ``AIRFLOW__OPENLINEAGE__DISABLED``, and
the jobs' namespace ``AIRFLOW__OPENLINEAGE__NAMESPACE`` (else ``OPENLINEAGE_NAMESPACE``, else
``default``), as the provider reads it.
A client that found no transport (it would print events on the console) means nothing is emitted.
Emission never fails a step: an error building the datasets or sending an event is logged and
counted in :attr:`EventSink.failed`.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator
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
AIRFLOW_TRANSPORT = "AIRFLOW__OPENLINEAGE__TRANSPORT"
AIRFLOW_DISABLED = "AIRFLOW__OPENLINEAGE__DISABLED"
_TRUE = ("1", "true", "t")  # as the provider reads its booleans
_NAMESPACE = ("AIRFLOW__OPENLINEAGE__NAMESPACE", "OPENLINEAGE_NAMESPACE")  # the provider's order
_CLIENT_LOGGER = "openlineage.client.client"


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


def _airflow_transport(text: str) -> dict[str, Any] | None:
    """The transport ``AIRFLOW__OPENLINEAGE__TRANSPORT`` holds (None when it is empty).

    Anything but a JSON object with a ``type`` raises :class:`ConfigError` naming the variable.
    """
    if not text.strip():
        return None
    try:
        transport = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{AIRFLOW_TRANSPORT} is not JSON: {exc}") from None
    if not isinstance(transport, dict) or "type" not in transport:
        raise ConfigError(f"{AIRFLOW_TRANSPORT} must be a JSON object with a type, got {text!r}")
    return transport


def sink_from_environment() -> EventSink | NoLineage:
    """:class:`EventSink` over the client this process's environment configures, else :data:`NO_LINEAGE`."""
    if os.environ.get(AIRFLOW_DISABLED, "").strip().lower() in _TRUE:
        return NO_LINEAGE
    transport = _airflow_transport(os.environ.get(AIRFLOW_TRANSPORT, ""))
    from openlineage.client import OpenLineageClient

    client_log = logging.getLogger(_CLIENT_LOGGER)
    client_log.addFilter(_not_about_the_console)
    try:
        client = OpenLineageClient(config={"transport": transport} if transport else None)
    finally:
        client_log.removeFilter(_not_about_the_console)
    if not _emits(client):
        return NO_LINEAGE
    namespace = next((os.environ[name] for name in _NAMESPACE if os.environ.get(name)), DEFAULT_NAMESPACE)
    return EventSink(client, namespace=namespace)


def _emits(client: Any) -> bool:
    """Whether ``client`` sends events somewhere: it is not disabled (a ``noop`` transport) and did not fall
    back to the console for want of any configured transport."""
    kind = client.transport.kind
    configured = bool((client.config.transport or {}).get("type"))
    return kind != "noop" and (kind != "console" or configured)


def _not_about_the_console(record: logging.LogRecord) -> bool:
    """Drops the client's notices that it prints events on the console: unconfigured, this sink emits nothing."""
    return "console" not in record.getMessage()


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
