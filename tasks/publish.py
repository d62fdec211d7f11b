"""The publish stage: commit a staged dataset once validation and, where needed, a person let it through.

``dataset/_COMMITTED.json`` — the one object consumers trust — is the staged manifest
(``dataset/_STAGED.json``, written by finalize) plus each suite's outcome (status, report,
expectations that warned), the review decision (:mod:`tasks.review`) and the dataset card, which
publish writes just before it. Publish refuses, with :class:`PublishRefusedError` and a named
``reason``, when

* ``not_staged``: finalize has not built the dataset;
* ``not_validated``: a suite has not run;
* ``validation_failed``: a suite failed (nothing overrides that, not even an approval);
* ``review_required``: a suite warned, or the caller requires review, and nobody has approved;
* ``rejected``: the batch was rejected — forever, since a decision is recorded once.

A batch whose validation failed or that was rejected keeps its staged dataset and its reports, and
nobody trains on it by accident. Publishing a published batch is a no-op that returns its manifest.
:func:`record_decision` is the one writer of a person's decisions: the CLI
(``publish --approve/--reject``) and the Airflow ``review`` task both go through it.

Exactly one of published and rejected: ``reports/review.json`` is created once and decides. A
publish that needs no review first records that in it (:func:`tasks.review.unreviewed_decision`)
and commits only if that record, or an approval, is what the slot holds; a rejection is recorded
only in an empty slot. Whichever write comes second finds the first and is refused (a rejection
with :class:`ReviewConflictError`, a publish with :class:`PublishRefusedError` ``rejected``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks.finalize.card import render_card
from tasks.finalize.publish import DatasetMarker, read_dataset_marker, read_staged_marker
from tasks.plan import batch_store
from tasks.review import REVIEW_RECORD, ReviewDecision, read_review, unreviewed_decision, write_review
from tasks.storage import layout
from tasks.storage.marker import MarkedFile, read_marked_bytes
from tasks.storage.objects import ObjectConflictError, ObjectStore
from tasks.storage.options import StorageOptions
from tasks.validate.suites import SUITES

PUBLISHABLE = ("passed", "warned")
REFUSALS = ("not_staged", "not_validated", "validation_failed", "review_required", "rejected")


class PublishRefusedError(RuntimeError):
    """The staged dataset may not be published (yet); ``reason`` is one of :data:`REFUSALS`, the message says why."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class ReviewConflictError(ObjectConflictError):
    """A decision that contradicts what the batch already holds (an earlier decision, a published dataset)."""


@dataclass(frozen=True)
class PublishedBatch:
    """Where the published dataset is and its committed manifest; ``created`` is False for a no-op."""

    url: str
    marker: DatasetMarker
    created: bool


def publish_batch(
    root_url: str, batch_id: str, *, require_review: bool = False, storage_options: StorageOptions | None = None
) -> PublishedBatch:
    """Write the card and ``dataset/_COMMITTED.json`` for ``batch_id`` unless refused; see above.

    ``require_review`` asks for an approval even when both suites passed (an Airflow run's
    ``require_review`` param).
    """
    store = batch_store(root_url, batch_id, storage_options)
    published = read_dataset_marker(store)
    if published is not None:
        return PublishedBatch(url=store.url, marker=published, created=False)
    review = read_review(store, batch_id)
    if review is not None and not review.approved:
        raise PublishRefusedError(
            f"batch {batch_id} is not published: it was rejected ({review.describe()}); "
            "a rejected batch is never published",
            reason="rejected",
        )
    staged = staged_dataset(store, batch_id)
    outcomes = validation_outcomes(store, batch_id)
    needed = review_reasons(outcomes, require_review=require_review)
    if needed and review is None:
        raise PublishRefusedError(
            f"batch {batch_id} needs review before it is published: {'; '.join(needed)}. Read "
            f"{store.url}/{layout.REPORTS_INDEX}, then approve or reject it: answer its Airflow review task, or run "
            f"`rollout-ledger publish --root ROOT --batch-id {batch_id} --approve --reason TEXT` (or --reject)",
            reason="review_required",
        )
    if review is None:
        review = _claim_unreviewed(store, batch_id)
    person = None if review.unreviewed else review
    card = _write_card(store, staged, outcomes, person)
    marker = dataclasses.replace(staged, card=card, validation=outcomes, review=person, committed_at=time.time())
    try:
        store.write_once(layout.DATASET_MARKER, marker.to_json().encode("utf-8"))
    except ObjectConflictError:  # another publisher won: its manifest is the published one
        return PublishedBatch(url=store.url, marker=_published(store), created=False)
    return PublishedBatch(url=store.url, marker=marker, created=True)


def record_decision(
    root_url: str, batch_id: str, decision: ReviewDecision, *, storage_options: StorageOptions | None = None
) -> ReviewDecision:
    """Record ``decision`` in ``reports/review.json`` once, and return the batch's decision.

    An earlier decision with the same choice stands and is returned (the first one is the
    record); one with the other choice raises :class:`ReviewConflictError`, as does any decision
    on a batch published without one. An approval needs a batch publish could take (staged, both
    suites run, neither failed): :class:`PublishRefusedError` otherwise, and nothing is recorded.
    """
    if decision.batch_id != batch_id:
        raise ValueError(f"a decision on batch {decision.batch_id} cannot be recorded on batch {batch_id}")
    if decision.unreviewed:
        raise ValueError("publish records that no review was needed; a decision is a person's (or a timeout's)")
    store = batch_store(root_url, batch_id, storage_options)
    earlier = read_review(store, batch_id)
    if earlier is None:
        published = read_dataset_marker(store)
        if published is not None:  # published before publish recorded its own decision
            raise ReviewConflictError(
                f"batch {batch_id} was published without a review at {store.url}/{layout.DATASET_MARKER}: "
                f"a decision to {decision.choice} it now changes nothing"
            )
        if decision.approved:
            staged_dataset(store, batch_id)
            validation_outcomes(store, batch_id)
        earlier = write_review(store, decision)
    if earlier.unreviewed:
        raise ReviewConflictError(
            f"batch {batch_id} is published without a review ({earlier.describe()}, recorded in "
            f"{store.url}/{REVIEW_RECORD}): a decision to {decision.choice} it now changes nothing"
        )
    if earlier.choice != decision.choice:
        raise ReviewConflictError(
            f"batch {batch_id} was already decided ({earlier.describe()}); a decision is recorded once, "
            f"so it cannot be changed to {decision.choice}"
        )
    return earlier


def review_reasons(outcomes: Mapping[str, Mapping[str, Any]], *, require_review: bool) -> list[str]:
    """Why a person must decide before publish: each suite that warned (naming what), and ``require_review``."""
    reasons = [
        f"the {suite} suite warned ({', '.join(outcome['warned'])})"
        for suite, outcome in outcomes.items()
        if outcome["status"] == "warned"
    ]
    if require_review:
        reasons.append("the run requires review (require_review)")
    return reasons


def validation_outcomes(store: ObjectStore, batch_id: str) -> dict[str, Any]:
    """Each suite's outcome for the committed manifest; :class:`PublishRefusedError` unless all are publishable."""
    from tasks.validate import read_suite_summary

    outcomes: dict[str, Any] = {}
    for suite in SUITES:
        summary = read_suite_summary(store, suite)
        if summary is None:
            raise PublishRefusedError(
                f"batch {batch_id}: the {suite} suite has not run: "
                f"run `rollout-ledger validate --suite {suite}` (or `rollout-ledger finalize`) first",
                reason="not_validated",
            )
        if summary.status not in PUBLISHABLE:
            failed = ", ".join(e.name for e in summary.expectations if not e.success and e.severity == "fail")
            raise PublishRefusedError(
                f"batch {batch_id} is not published: the {suite} suite failed ({failed}); "
                f"see {store.url}/{summary.report} and {store.url}/{layout.REPORTS_INDEX}",
                reason="validation_failed",
            )
        outcomes[suite] = {
            "status": summary.status,
            "report": summary.report,
            "warned": [e.name for e in summary.expectations if not e.success and e.severity == "warn"],
            "gx_version": summary.gx_version,
            "validated_at": summary.created_at,
        }
    return outcomes


def staged_dataset(store: ObjectStore, batch_id: str) -> DatasetMarker:
    """The staged manifest; :class:`PublishRefusedError` (``not_staged``) when finalize has not built it."""
    staged = read_staged_marker(store)
    if staged is None:
        raise PublishRefusedError(
            f"batch {batch_id} has no staged dataset at {store.url}/{layout.DATASET_STAGED}: "
            "run `rollout-ledger finalize`",
            reason="not_staged",
        )
    return staged


def _claim_unreviewed(store: ObjectStore, batch_id: str) -> ReviewDecision:
    """Record that the batch is published without review, unless a decision got there first; returns the slot's.

    A rejection that got there first refuses the publish (``rejected``).
    """
    recorded = write_review(store, unreviewed_decision(batch_id))
    if not recorded.approved:
        raise PublishRefusedError(
            f"batch {batch_id} is not published: it was rejected while publish ran ({recorded.describe()}); "
            "a rejected batch is never published",
            reason="rejected",
        )
    return recorded


def _write_card(
    store: ObjectStore, staged: DatasetMarker, outcomes: dict[str, Any], review: ReviewDecision | None
) -> MarkedFile:
    """``dataset/README.md`` for the manifest about to be committed (the same bytes again if a crash left it)."""
    metrics = json.loads(read_marked_bytes(store, staged.metrics, marker="the staged dataset marker"))
    card = render_card(
        batch_id=staged.batch_id,
        config=staged.config,
        metrics=metrics,
        parts=[dataclasses.asdict(part) for part in staged.parts],
        validation=outcomes,
        review=review,
    )
    return MarkedFile.of(store.write_once(layout.DATASET_CARD, card.encode("utf-8")), kind="card", rows=0)


def _published(store: ObjectStore) -> DatasetMarker:
    marker = read_dataset_marker(store)
    if marker is None:
        raise RuntimeError(f"{store.url}/{layout.DATASET_MARKER} conflicted but cannot be read")
    return marker
