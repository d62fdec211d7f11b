"""A batch's status, read from its storage alone: :func:`batch_status` is the only entry that reads.

It reads the plan, every planned shard (:mod:`tasks.status.shards`), the dataset manifests with
the suites' current summaries and the review decision (``reports/review.json``), and the list of
reports, and names the next step (:mod:`tasks.status.next_step`). Nothing is written, renamed or
deleted. Only a batch that was never planned raises; every later problem is reported in the status.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from tasks import layout
from tasks.batch import Batch
from tasks.errors import MalformedReviewError, StorageIntegrityError
from tasks.publish import PUBLISHABLE
from tasks.records.suite_summary import SUITES
from tasks.status.model import (
    BatchStatus,
    CommittedShard,
    DatasetStatus,
    PlanStatus,
    ReportsStatus,
    ResumeCounts,
    Totals,
)
from tasks.status.next_step import next_step
from tasks.status.shards import shard_status

ACTIVE_WITHIN_S = 600.0  # an attempt that wrote nothing for this long is taken as abandoned


def batch_status(batch: Batch, *, now: float | None = None, active_within_s: float = ACTIVE_WITHIN_S) -> BatchStatus:
    """The status of ``batch``, read without writing anything.

    Raises :class:`~tasks.errors.ConfigError` naming the URL when the batch was never planned;
    any later problem (a corrupt marker, claim or ledger file) is reported in the status instead.
    """
    config = batch.config
    now = time.time() if now is None else now
    shards = tuple(shard_status(batch, shard, now - active_within_s) for shard in range(config.shards))
    reports = _reports_status(batch)
    dataset = _dataset_status(batch)
    root_url, batch_id = batch.root_url, batch.batch_id
    return BatchStatus(
        batch_id=batch_id,
        root_url=root_url,
        url=batch.url,
        observed_at=now,
        plan=PlanStatus.of(config),
        shards=shards,
        totals=_totals(s.committed for s in shards if s.committed is not None),
        dataset=dataset,
        reports=reports,
        next_step=next_step(root_url, batch_id, shards, dataset, reports),
    )


def _totals(committed: Iterable[CommittedShard]) -> Totals:
    shards = list(committed)
    failures: Counter[str] = Counter()
    poisoned: Counter[str] = Counter()
    for shard in shards:
        failures.update(shard.failures_by_reason)
        poisoned.update(shard.poisoned_by_reason)
    minima = [s.weight_version_min for s in shards if s.weight_version_min is not None]
    maxima = [s.weight_version_max for s in shards if s.weight_version_max is not None]
    return Totals(
        committed_shards=len(shards),
        rollouts=sum(s.counts.rollouts for s in shards),
        ok=sum(s.counts.ok for s in shards),
        poisoned=sum(s.counts.poisoned for s in shards),
        failed=sum(s.counts.failed for s in shards),
        calls=sum(s.calls for s in shards),
        calls_recorded=sum(s.counts.calls_recorded for s in shards),
        failure_rows=sum(s.counts.failures for s in shards),
        failures_by_reason=dict(sorted(failures.items())),
        poisoned_by_reason=dict(sorted(poisoned.items())),
        weight_version_min=min(minima, default=None),
        weight_version_max=max(maxima, default=None),
        resumed=sum((s.resumed for s in shards), ResumeCounts()),
    )


def _reports_status(batch: Batch) -> ReportsStatus:
    objects = batch.report_objects()
    return ReportsStatus(objects=objects, index=layout.REPORTS_INDEX if layout.REPORTS_INDEX in objects else None)


def _dataset_status(batch: Batch) -> DatasetStatus:
    """Published (a valid committed manifest) wins, then a rejection; a staged dataset is judged by its suites."""
    suites = _suite_outcomes(batch)
    try:
        review = batch.review()
        marker = batch.dataset()
    except (StorageIntegrityError, MalformedReviewError, ValueError, OSError) as exc:
        return DatasetStatus(state="unreadable", suites=suites, error=f"{type(exc).__name__}: {exc}")
    rejected = review is not None and not review.approved
    if marker is None:
        return DatasetStatus(state="rejected" if rejected else "none", suites=suites, review=review)
    if marker.validation is not None:
        state = "published"
    elif rejected:
        state = "rejected"
    elif any(suites.get(suite) in ("failed", "unreadable") for suite in SUITES):
        state = "validation_failed"
    elif all(suites.get(suite) in PUBLISHABLE for suite in SUITES):
        state = "awaiting_review" if review is None and "warned" in suites.values() else "validated"
    else:
        state = "staged"
    return DatasetStatus(
        state=state,
        partial=marker.partial,
        missing_shards=tuple(marker.missing_shards),
        rows=marker.rows,
        trainable_rows=marker.trainable_rows,
        groups=marker.groups,
        suites=suites,
        review=review,
    )


def _suite_outcomes(batch: Batch) -> dict[str, str]:
    """Each suite's status in its current run (``passed``/``warned``/``failed``/``unreadable``); unrun ones left out."""
    outcomes = {}
    for suite in SUITES:
        try:
            summary = batch.suite_summary(suite)
        except (ValueError, OSError):
            outcomes[suite] = "unreadable"
            continue
        if summary is not None:
            outcomes[suite] = summary.status
    return outcomes
