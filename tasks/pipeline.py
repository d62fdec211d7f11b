"""After generation, in order: lineage validation, finalize (build), dataset validation, publish.

What ``rollout-ledger finalize`` runs (the Airflow DAG runs each step as its own task, with a
review step before publish). Every step is idempotent, so running this again after a failure or a
crash picks up where it stopped. A failed suite stops the run with :class:`ValidationFailedError`:
nothing after it runs, its reports stay, and no ``dataset/_COMMITTED.json`` is written; a suite
that warned stops it at publish until a person decides (:func:`decide_and_report`). The overview
page ``reports/index.html`` is rewritten after each suite, each decision and publish.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tasks.batch import Batch
from tasks.config import ValidationSpec
from tasks.errors import ConfigError, ValidationFailedError
from tasks.finalize.dataset_writer import StagedDataset
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.lineage.datasets import finalize_lineage, publish_lineage, suite_lineage
from tasks.lineage.emit import NO_LINEAGE, LineageSink
from tasks.publish import PublishedBatch, publish_batch, record_decision
from tasks.records.review import ReviewDecision
from tasks.validate.stage import SuiteOutcome


@dataclass(frozen=True)
class PipelineResult:
    """What each step produced; ``published`` is None when publishing was not asked for."""

    staged: StagedDataset
    suites: dict[str, SuiteOutcome]
    published: PublishedBatch | None


def thresholds_with(batch: Batch, overrides: Mapping[str, Any]) -> ValidationSpec:
    """The batch config's validation thresholds with ``overrides`` applied (unknown names are refused)."""
    planned = batch.config.validation
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ValidationSpec)})
    if unknown:
        known = [f.name for f in dataclasses.fields(ValidationSpec)]
        raise ConfigError(f"unknown validation threshold(s) {unknown}; known: {known}")
    try:
        return dataclasses.replace(planned, **overrides)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"validation thresholds: {exc}") from None


def run_suite(suite: str, batch: Batch, *, thresholds: ValidationSpec | None = None) -> SuiteOutcome:
    """Run one suite, rewrite the overview page, and return the suite's outcome (failed or not)."""
    from tasks.report import write_report_index
    from tasks.validate import validate_dataset, validate_lineage

    validate: Callable[..., SuiteOutcome] = {"lineage": validate_lineage, "dataset": validate_dataset}[suite]
    outcome = validate(batch, thresholds=thresholds)
    write_report_index(batch)
    return outcome


def finalize_and_publish(
    batch: Batch,
    options: FinalizeOptions | None = None,
    *,
    thresholds: ValidationSpec | None = None,
    publish: bool = True,
    lineage: LineageSink = NO_LINEAGE,
) -> PipelineResult:
    """Lineage suite, build, dataset suite, publish; with ``publish=False``, lineage suite and build only.

    Each step is a task run of ``lineage`` (the DAG's task ids), reporting its datasets.
    """
    suites = {"lineage": _passed("lineage", batch, thresholds, lineage)}
    with lineage.task("finalize", batch) as run:
        staged = finalize_batch(batch, options)
        run.report(lambda: finalize_lineage(batch))
    if not publish:
        return PipelineResult(staged=staged, suites=suites, published=None)
    suites["dataset"] = _passed("dataset", batch, thresholds, lineage)
    with lineage.task("publish", batch) as run:
        published = publish_and_report(batch)
        run.report(lambda: publish_lineage(batch))
    return PipelineResult(staged=staged, suites=suites, published=published)


def publish_and_report(batch: Batch, *, require_review: bool = False) -> PublishedBatch:
    """Publish, then rewrite the overview page so it says the dataset is published."""
    from tasks.report import write_report_index

    published = publish_batch(batch, require_review=require_review)
    write_report_index(batch)
    return published


def decide_and_report(batch: Batch, decision: ReviewDecision) -> ReviewDecision:
    """Record a review decision (:func:`tasks.publish.record_decision`), then rewrite the overview page.

    Returns the batch's decision: ``decision``, or the earlier one with the same choice.
    """
    from tasks.report import write_report_index

    recorded = record_decision(batch, decision)
    write_report_index(batch)
    return recorded


def validate_suite(
    suite: str, batch: Batch, *, thresholds: ValidationSpec | None = None, lineage: LineageSink = NO_LINEAGE
) -> SuiteOutcome:
    """Run ``suite`` as a task run of ``lineage`` and return its outcome, failed or not.

    The run reports the suite's assertions, failed ones included, and ends in FAIL when the suite
    failed the batch, as the DAG's task does.
    """
    with contextlib.suppress(ValidationFailedError), lineage.task(f"validate_{suite}", batch) as run:
        outcome = run_suite(suite, batch, thresholds=thresholds)
        run.report(lambda: suite_lineage(batch, outcome.summary))
        if outcome.status == "failed":
            raise ValidationFailedError(describe_failure(suite, outcome))  # the run's FAIL, suppressed here
    return outcome


def _passed(suite: str, batch: Batch, thresholds: ValidationSpec | None, lineage: LineageSink) -> SuiteOutcome:
    outcome = validate_suite(suite, batch, thresholds=thresholds, lineage=lineage)
    if outcome.status == "failed":
        raise ValidationFailedError(describe_failure(suite, outcome))
    return outcome


def describe_failure(suite: str, outcome: SuiteOutcome) -> str:
    """One line naming the failed expectations of ``suite`` (with a few offending ids) and its report."""
    failed = "; ".join(
        f"{e.name} ({', '.join(map(str, e.examples[:3])) or 'no examples'})"
        for e in outcome.summary.expectations
        if not e.success and e.severity == "fail"
    )
    return f"the {suite} suite failed the batch: {failed}; report: {outcome.report_url}"
