"""The publish stage: commit a staged dataset once validation and, where needed, a person let it through.

``dataset/_COMMITTED.json`` — the one object consumers trust — is the staged manifest
(``dataset/_STAGED.json``, written by finalize) plus each suite's outcome (status, report,
expectations that warned), the review decision (:mod:`tasks.records.review`) and the dataset card, which
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
publish that needs no review first records that in it (:func:`tasks.records.review.unreviewed_decision`)
and commits only if that record, or an approval, is what the slot holds; a rejection is recorded
only in an empty slot. Whichever write comes second finds the first and is refused (a rejection
with :class:`ReviewConflictError`, a publish with :class:`PublishRefusedError` ``rejected``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks import layout
from tasks.batch import Batch
from tasks.errors import ObjectConflictError, PublishRefusedError, ReviewConflictError
from tasks.finalize.card import render_card
from tasks.records.review import ReviewDecision, unreviewed_decision
from tasks.records.suite_summary import SUITES
from tasks.storage.dataset_manifest import DatasetMarker
from tasks.storage.marker import MarkedFile

PUBLISHABLE = ("passed", "warned")


@dataclass(frozen=True)
class PublishedBatch:
    """Where the published dataset is and its committed manifest; ``created`` is False for a no-op."""

    url: str
    marker: DatasetMarker
    created: bool


def publish_batch(batch: Batch, *, require_review: bool = False) -> PublishedBatch:
    """Write the card and ``dataset/_COMMITTED.json`` of ``batch`` unless refused; see above.

    ``require_review`` asks for an approval even when both suites passed (an Airflow run's
    ``require_review`` param).
    """
    store, batch_id = batch.store, batch.batch_id
    published = batch.published_dataset()
    if published is not None:
        return PublishedBatch(url=store.url, marker=published, created=False)
    review = batch.review()
    if review is not None and not review.approved:
        raise PublishRefusedError(
            f"batch {batch_id} is not published: it was rejected ({review.describe()}); "
            "a rejected batch is never published",
            reason="rejected",
        )
    staged = staged_dataset(batch)
    outcomes = validation_outcomes(batch)
    needed = review_reasons(outcomes, require_review=require_review)
    if needed and review is None:
        raise PublishRefusedError(
            f"batch {batch_id} needs review before it is published: {'; '.join(needed)}. Read "
            f"{store.url}/{layout.REPORTS_INDEX}, then approve or reject it: answer its Airflow review task, or run "
            f"`rollout-ledger publish --root ROOT --batch-id {batch_id} --approve --reason TEXT` (or --reject)",
            reason="review_required",
        )
    if review is None:
        review = _claim_unreviewed(batch)
    person = None if review.unreviewed else review
    card = _write_card(batch, staged, outcomes, person)
    marker = dataclasses.replace(staged, card=card, validation=outcomes, review=person, committed_at=time.time())
    try:
        store.write_once(layout.DATASET_MARKER, marker.to_json().encode("utf-8"))
    except ObjectConflictError:  # another publisher won: its manifest is the published one
        return PublishedBatch(url=store.url, marker=_published(batch), created=False)
    return PublishedBatch(url=store.url, marker=marker, created=True)


def record_decision(batch: Batch, decision: ReviewDecision) -> ReviewDecision:
    """Record ``decision`` in ``reports/review.json`` once, and return the batch's decision.

    An earlier decision with the same choice stands and is returned (the first one is the
    record); one with the other choice raises :class:`ReviewConflictError`, as does any decision
    on a batch published without one. An approval needs a batch publish could take (staged, both
    suites run, neither failed): :class:`PublishRefusedError` otherwise, and nothing is recorded.
    """
    store, batch_id = batch.store, batch.batch_id
    if decision.batch_id != batch_id:
        raise ValueError(f"a decision on batch {decision.batch_id} cannot be recorded on batch {batch_id}")
    if decision.unreviewed:
        raise ValueError("publish records that no review was needed; a decision is a person's (or a timeout's)")
    earlier = batch.review()
    if earlier is None:
        published = batch.published_dataset()
        if published is not None:  # published before publish recorded its own decision
            raise ReviewConflictError(
                f"batch {batch_id} was published without a review at {store.url}/{layout.DATASET_MARKER}: "
                f"a decision to {decision.choice} it now changes nothing"
            )
        if decision.approved:
            staged_dataset(batch)
            validation_outcomes(batch)
        earlier = write_review(batch, decision)
    if earlier.unreviewed:
        raise ReviewConflictError(
            f"batch {batch_id} is published without a review ({earlier.describe()}, recorded in "
            f"{batch.url_of(layout.REVIEW_RECORD)}): a decision to {decision.choice} it now changes nothing"
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


def validation_outcomes(batch: Batch) -> dict[str, Any]:
    """Each suite's outcome for the committed manifest; :class:`PublishRefusedError` unless all are publishable."""
    batch_id = batch.batch_id
    outcomes: dict[str, Any] = {}
    for suite in SUITES:
        summary = batch.suite_summary(suite)
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
                f"see {batch.url_of(summary.report)} and {batch.url_of(layout.REPORTS_INDEX)}",
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


def staged_dataset(batch: Batch) -> DatasetMarker:
    """The staged manifest; :class:`PublishRefusedError` (``not_staged``) when finalize has not built it."""
    staged = batch.staged_dataset()
    if staged is None:
        raise PublishRefusedError(
            f"batch {batch.batch_id} has no staged dataset at {batch.url_of(layout.DATASET_STAGED)}: "
            "run `rollout-ledger finalize`",
            reason="not_staged",
        )
    return staged


def _claim_unreviewed(batch: Batch) -> ReviewDecision:
    """Record that the batch is published without review, unless a decision got there first; returns the slot's.

    A rejection that got there first refuses the publish (``rejected``).
    """
    recorded = write_review(batch, unreviewed_decision(batch.batch_id))
    if not recorded.approved:
        raise PublishRefusedError(
            f"batch {batch.batch_id} is not published: it was rejected while publish ran ({recorded.describe()}); "
            "a rejected batch is never published",
            reason="rejected",
        )
    return recorded


def _write_card(
    batch: Batch, staged: DatasetMarker, outcomes: dict[str, Any], review: ReviewDecision | None
) -> MarkedFile:
    """``dataset/README.md`` for the manifest about to be committed (the same bytes again if a crash left it)."""
    metrics = batch.dataset_metrics(staged)
    card = render_card(
        batch_id=staged.batch_id,
        config=staged.config,
        metrics=metrics,
        parts=[dataclasses.asdict(part) for part in staged.parts],
        validation=outcomes,
        review=review,
    )
    return MarkedFile.of(batch.store.write_once(layout.DATASET_CARD, card.encode("utf-8")), kind="card", rows=0)


def _published(batch: Batch) -> DatasetMarker:
    marker = batch.published_dataset()
    if marker is None:
        raise RuntimeError(f"{batch.url_of(layout.DATASET_MARKER)} conflicted but cannot be read")
    return marker


def write_review(batch: Batch, decision: ReviewDecision) -> ReviewDecision:
    """Create the record unless one exists; returns the decision now on storage (``decision`` or the earlier one)."""
    try:
        batch.store.write_once(layout.REVIEW_RECORD, decision.to_json().encode("utf-8"))
    except ObjectConflictError:
        earlier = batch.review()
        if earlier is None:
            raise
        return earlier
    return decision
