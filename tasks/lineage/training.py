"""OpenLineage events of a training step: the datasets it consumed and the checkpoint it started from in, the
checkpoint it wrote out (docs/lineage.md, "Checkpoints").

The training step is one run of job ``grpo_train.train_step`` (the DAG's task, as the provider names jobs):

* inputs: each consumed dataset, named as the batch's ``dataset/`` is everywhere else (so the graph joins
  ``rollout_batch.publish``'s output), with a ``version`` facet holding the sha256 of its ``_COMMITTED.json``;
  and the parent checkpoint's folder (a local file dataset, ``version`` = its weights' sha256);
* output (COMPLETE only): the new checkpoint's folder, ``version`` = its weights' sha256.

A batch planned with a checkpoint folder as its model names that folder as its model input
(:func:`tasks.lineage.naming.model`), so checkpoint → batch → dataset → step → checkpoint is one connected graph.
:func:`training_lineage_events` builds the START and COMPLETE events of a step from the checkpoint it wrote (the
manifest says what it consumed and started from); :func:`training_run_event` builds one event, for a caller that
emits START before the step (outputs unknown yet) and COMPLETE or FAIL after. Emitting is the caller's: under
Airflow the provider emits START/COMPLETE itself and a task adds these datasets; elsewhere
``OpenLineageClient().emit(event)``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import error_message_run, job_type_job, processing_engine_run

from tasks import layout
from tasks.lineage import facets
from tasks.lineage.emit import DEFAULT_NAMESPACE, PRODUCER
from tasks.lineage.naming import name_of_url
from tasks.trainer.checkpoint import Checkpoint, ConsumedDataset, ParentCheckpoint, read_checkpoint
from tasks.version import code_version

TRAINING_JOB = "grpo_train.train_step"


def dataset_input(consumed: ConsumedDataset) -> InputDataset:
    """A consumed dataset as an input: the batch's ``dataset/``, versioned by its committed marker's sha256."""
    name = name_of_url(f"{consumed.batch_url.rstrip('/')}/{layout.DATASET_DIR}")
    return InputDataset(name.namespace, name.name, facets={"version": facets.version(consumed.dataset_sha256)})


def checkpoint_input(parent: ParentCheckpoint) -> InputDataset:
    """The checkpoint a step started from, versioned by its weights' sha256."""
    name = name_of_url(parent.folder)
    return InputDataset(name.namespace, name.name, facets={"version": facets.version(parent.weights_sha256)})


def checkpoint_output(checkpoint: Checkpoint) -> OutputDataset:
    """The checkpoint a step wrote, versioned by its weights' sha256."""
    name = name_of_url(str(checkpoint.folder))
    return OutputDataset(name.namespace, name.name, facets={"version": facets.version(checkpoint.weights_sha256)})


def training_run_event(
    event_type: str,
    *,
    run_id: str,
    consumed: Sequence[ConsumedDataset],
    parent: ParentCheckpoint | None,
    checkpoint: Checkpoint | None = None,
    error: BaseException | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    job_name: str = TRAINING_JOB,
    event_time: datetime | None = None,
) -> RunEvent:
    """One event of a training step's run (``START``, ``RUNNING``, ``COMPLETE`` or ``FAIL``; ``error`` on a FAIL)."""
    run_facets: dict[str, Any] = {
        "processing_engine": processing_engine_run.ProcessingEngineRunFacet(
            version=code_version().removeprefix("rollout-ledger "), name="rollout-ledger"
        ),
    }
    if error is not None:
        run_facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
            message=f"{type(error).__name__}: {error}", programmingLanguage="python"
        )
    job_type = job_type_job.JobTypeJobFacet(processingType="BATCH", integration="ROLLOUT_LEDGER", jobType="TASK")
    inputs = [dataset_input(c) for c in consumed] + ([checkpoint_input(parent)] if parent is not None else [])
    return RunEvent(
        eventType=RunState[event_type],
        eventTime=(event_time or datetime.now(tz=UTC)).isoformat(),
        run=Run(runId=run_id, facets=run_facets),
        job=Job(namespace=namespace, name=job_name, facets={"jobType": job_type}),
        inputs=inputs,
        outputs=[checkpoint_output(checkpoint)] if checkpoint is not None else [],
        producer=PRODUCER,
    )


def training_lineage_events(
    checkpoint: Checkpoint | str | Path,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    job_name: str = TRAINING_JOB,
    run_id: str | None = None,
    started_at: datetime | None = None,
    finished_at: datetime | None = None,
) -> list[RunEvent]:
    """START and COMPLETE of the step that wrote ``checkpoint`` (a :class:`Checkpoint` or its folder, whose weights
    are verified): inputs the datasets its manifest consumed and its parent, output the checkpoint. ``run_id``
    defaults to one derived from the checkpoint's weights, so describing the same step twice names one run."""
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = read_checkpoint(checkpoint)
    manifest = checkpoint.manifest
    run = run_id or str(uuid.uuid5(uuid.NAMESPACE_URL, f"rollout-ledger-checkpoint:{checkpoint.weights_sha256}"))
    finished = finished_at or datetime.fromisoformat(manifest.created_at)
    common = {"run_id": run, "consumed": manifest.consumed, "parent": manifest.parent, "namespace": namespace}
    return [
        training_run_event("START", **common, job_name=job_name, event_time=started_at or finished),
        training_run_event("COMPLETE", **common, job_name=job_name, checkpoint=checkpoint, event_time=finished),
    ]
