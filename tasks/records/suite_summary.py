"""A suite run's machine-readable outcome, ``summary.json``: what passed, what failed, which rows.

Status: ``failed`` when a ``fail`` expectation failed, else ``warned`` when a ``warn`` one did,
else ``passed``; ``success`` is ``status != "failed"`` (publish may go ahead). The JSON keeps
the field order of the dataclasses (the documented format) and is parsed strictly: an unknown,
missing or inconsistent field raises :class:`MalformedSummaryError` naming it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Self

from tasks.checks import check_choice, check_finite, check_int, check_text, is_hex_digest, is_number
from tasks.errors import MalformedSummaryError
from tasks.strict_json import dump_document, load_document

LINEAGE, DATASET = "lineage", "dataset"
SUITES = (LINEAGE, DATASET)  # the validation suites, in the order they run
SEVERITIES = ("fail", "warn")
STATUSES = ("passed", "warned", "failed")


@dataclass(frozen=True)
class ExpectationOutcome:
    """One expectation's line in the summary.

    ``observed`` is the share of checked rows that broke the rule (``expected_rate`` specs: that
    kept it), None when no row was checked; ``threshold`` the bound used (None for a plain rule);
    ``examples`` a few ids of offending rows; ``error`` GX's message when the expectation raised.
    """

    name: str
    expectation: str
    severity: str
    success: bool
    observed: float | None
    threshold: Any
    unexpected_count: int
    examples: tuple[str, ...]
    error: str | None

    def __post_init__(self) -> None:
        check_text(self.name, field="name")
        check_text(self.expectation, field=f"{self.name}.expectation")
        check_choice(self.severity, SEVERITIES, field=f"{self.name}.severity")
        if not isinstance(self.success, bool):
            raise TypeError(f"{self.name}.success must be a bool, got {self.success!r}")
        if self.observed is not None:
            check_finite(self.observed, field=f"{self.name}.observed")
        if not (self.threshold is None or is_number(self.threshold) or isinstance(self.threshold, list)):
            raise TypeError(f"{self.name}.threshold must be a number, a list or null, got {self.threshold!r}")
        check_int(self.unexpected_count, field=f"{self.name}.unexpected_count")
        if not all(isinstance(e, str) for e in self.examples):
            raise TypeError(f"{self.name}.examples must be ids (str), got {self.examples!r}")


@dataclass(frozen=True)
class SummaryCounts:
    """Expectations run, ``fail`` ones that failed, ``warn`` ones that failed, rows of the suite's main table."""

    expectations: int
    failed: int
    warned: int
    rows: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_int(getattr(self, f.name), field=f"counts.{f.name}")


@dataclass(frozen=True)
class SuiteSummary:
    """``reports/{suite}/run-NNN/summary.json``; constructing one checks that status, success and counts agree.

    ``report`` is the batch-relative path of the run's Data Docs index; ``run`` the run directory's
    name; ``run_key`` the sha256 of what the run read and the thresholds it used (an identical
    re-run is a no-op); ``inputs`` the sha256 of each marker the run trusted. ``thresholds`` are
    the validation spec's fields the run used (a number, or null for no bound), as recorded:
    records know nothing of the config (``ValidationSpec.of_recorded`` reads them back).
    """

    suite: str
    batch_id: str
    status: str
    success: bool
    expectations: tuple[ExpectationOutcome, ...]
    counts: SummaryCounts
    thresholds: dict[str, float | None]
    gx_version: str
    report: str
    created_at: float
    run: str
    run_key: str
    inputs: dict[str, str]

    def __post_init__(self) -> None:
        check_choice(self.suite, SUITES, field="suite")
        check_text(self.batch_id, field="batch_id")
        check_finite(self.created_at, field="created_at")
        for name in ("gx_version", "report", "run"):
            check_text(getattr(self, name), field=name)
        if not is_hex_digest(self.run_key):
            raise ValueError(f"run_key must be 64 lowercase hex digits, got {self.run_key!r}")
        if not isinstance(self.thresholds, dict) or not all(
            isinstance(k, str) and (v is None or (is_number(v) and math.isfinite(v)))
            for k, v in self.thresholds.items()
        ):
            raise ValueError(f"thresholds must map names to numbers or null, got {str(self.thresholds)[:200]}")
        if not isinstance(self.inputs, dict) or not all(is_hex_digest(v) for v in self.inputs.values()):
            raise ValueError(f"inputs must map paths to sha256 digests, got {self.inputs!r}")
        failed, warned = failures(self.expectations)
        expected = SummaryCounts(
            expectations=len(self.expectations), failed=failed, warned=warned, rows=self.counts.rows
        )
        if self.counts != expected:
            raise ValueError(f"counts {self.counts} disagree with the expectations listed ({expected})")
        if self.status != status_of(failed, warned) or self.success is not (self.status != "failed"):
            raise ValueError(
                f"status {self.status!r} / success {self.success!r} disagree with {failed} failed, {warned} warned"
            )

    def to_json(self) -> str:
        """The summary as JSON, fields in the documented order, two-space indent, trailing newline."""
        return dump_document(self)

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str) -> Self:
        return load_document(cls, text, source=source, error=MalformedSummaryError)


def status_of(failed: int, warned: int) -> str:
    """``failed`` if a fail expectation failed, ``warned`` if only warn ones did, else ``passed``."""
    return "failed" if failed else "warned" if warned else "passed"


def failures(outcomes: tuple[ExpectationOutcome, ...]) -> tuple[int, int]:
    """How many ``fail`` and how many ``warn`` expectations failed."""
    failed = [e.severity for e in outcomes if not e.success]
    return failed.count("fail"), failed.count("warn")
