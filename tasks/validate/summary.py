"""Building a suite run's summary (:class:`~tasks.records.suite_summary.SuiteSummary`) from GX's results."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tasks.config import ValidationSpec
from tasks.records.suite_summary import ExpectationOutcome, SuiteSummary, SummaryCounts, failures, status_of
from tasks.validate.gx_run import ExpectationResult
from tasks.validate.suites import ExpectationSpec, SuiteSpec


def expectation_outcome(spec: ExpectationSpec, result: ExpectationResult) -> ExpectationOutcome:
    """The summary line of one expectation's GX result."""
    rate = result.unexpected_rate
    observed = None if rate is None else (1.0 - rate if spec.observed == "expected_rate" else rate)
    return ExpectationOutcome(
        name=spec.name,
        expectation=spec.expectation,
        severity=spec.severity,
        success=result.success,
        observed=observed,
        threshold=spec.threshold,
        unexpected_count=result.unexpected_count,
        examples=result.examples,
        error=result.error,
    )


def build_summary(
    suite: SuiteSpec,
    results: Mapping[str, ExpectationResult],
    *,
    batch_id: str,
    rows: int,
    thresholds: ValidationSpec,
    gx_version: str,
    report: str,
    created_at: float,
    run: str,
    run_key: str,
    inputs: Mapping[str, str],
) -> SuiteSummary:
    """The summary of one run of ``suite`` from its expectations' results, in the suite's order."""
    outcomes = tuple(expectation_outcome(spec, results[spec.name]) for spec in suite.expectations)
    failed, warned = failures(outcomes)
    status = status_of(failed, warned)
    return SuiteSummary(
        suite=suite.name,
        batch_id=batch_id,
        status=status,
        success=status != "failed",
        expectations=outcomes,
        counts=SummaryCounts(expectations=len(outcomes), failed=failed, warned=warned, rows=rows),
        thresholds=dataclasses.asdict(thresholds),
        gx_version=gx_version,
        report=report,
        created_at=created_at,
        run=run,
        run_key=run_key,
        inputs=dict(inputs),
    )
