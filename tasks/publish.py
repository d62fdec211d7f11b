"""The publish stage: commit a staged dataset once both validation suites let it through (ARCHITECTURE 1, 2).

``dataset/_COMMITTED.json`` — the one object consumers trust — is the staged manifest
(``dataset/_STAGED.json``, written by finalize) plus each suite's outcome (status, report,
expectations that warned). Publish refuses, with :class:`PublishRefusedError` naming why and
where the reports are, when the dataset is not staged, a suite has not run, or a suite failed:
a batch whose validation failed keeps its staged dataset and its reports, and nobody trains on
it by accident. Publishing a published batch is a no-op that returns its manifest.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from tasks.finalize.publish import DatasetMarker, read_dataset_marker, read_staged_marker
from tasks.plan import batch_store
from tasks.storage import layout
from tasks.storage.objects import ObjectConflictError, ObjectStore
from tasks.storage.options import StorageOptions
from tasks.validate.suites import SUITES

PUBLISHABLE = ("passed", "warned")


class PublishRefusedError(RuntimeError):
    """The staged dataset may not be published (yet); the message says why and what to run."""


@dataclass(frozen=True)
class PublishedBatch:
    """Where the published dataset is and its committed manifest; ``created`` is False for a no-op."""

    url: str
    marker: DatasetMarker
    created: bool


def publish_batch(root_url: str, batch_id: str, *, storage_options: StorageOptions | None = None) -> PublishedBatch:
    """Write ``dataset/_COMMITTED.json`` for ``batch_id`` if its staged dataset passed both suites; see above."""
    store = batch_store(root_url, batch_id, storage_options)
    published = read_dataset_marker(store)
    if published is not None:
        return PublishedBatch(url=store.url, marker=published, created=False)
    staged = read_staged_marker(store)
    if staged is None:
        raise PublishRefusedError(
            f"batch {batch_id} has no staged dataset at {store.url}/{layout.DATASET_STAGED}: "
            "run `rollout-ledger finalize`"
        )
    marker = dataclasses.replace(staged, validation=validation_outcomes(store, batch_id), committed_at=time.time())
    try:
        store.write_once(layout.DATASET_MARKER, marker.to_json().encode("utf-8"))
    except ObjectConflictError:  # another publisher won: its manifest is the published one
        return PublishedBatch(url=store.url, marker=_published(store), created=False)
    return PublishedBatch(url=store.url, marker=marker, created=True)


def validation_outcomes(store: ObjectStore, batch_id: str) -> dict[str, Any]:
    """Each suite's outcome for the committed manifest; :class:`PublishRefusedError` unless all are publishable."""
    from tasks.validate import read_suite_summary

    outcomes: dict[str, Any] = {}
    for suite in SUITES:
        summary = read_suite_summary(store, suite)
        if summary is None:
            raise PublishRefusedError(
                f"batch {batch_id}: the {suite} suite has not run: "
                f"run `rollout-ledger validate --suite {suite}` (or `rollout-ledger finalize`) first"
            )
        if summary.status not in PUBLISHABLE:
            failed = ", ".join(e.name for e in summary.expectations if not e.success and e.severity == "fail")
            raise PublishRefusedError(
                f"batch {batch_id} is not published: the {suite} suite failed ({failed}); "
                f"see {store.url}/{summary.report} and {store.url}/{layout.REPORTS_INDEX}"
            )
        outcomes[suite] = {
            "status": summary.status,
            "report": summary.report,
            "warned": [e.name for e in summary.expectations if not e.success and e.severity == "warn"],
            "gx_version": summary.gx_version,
            "validated_at": summary.created_at,
        }
    return outcomes


def _published(store: ObjectStore) -> DatasetMarker:
    marker = read_dataset_marker(store)
    if marker is None:
        raise RuntimeError(f"{store.url}/{layout.DATASET_MARKER} conflicted but cannot be read")
    return marker
