"""The report tests' batch config, and suite summaries written the way the validation stage writes them."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from tasks.config import BatchConfig, ValidationSpec
from tasks.records.suite_summary import ExpectationOutcome, SuiteSummary, SummaryCounts, status_of
from tasks.sampling import SamplingSettings
from tests.generation.configs import fake_model_config

BATCH = "b-report"
HOSTILE = "<img src=x onerror=alert(1)>"


def report_config(**overrides: Any) -> BatchConfig:
    """The generate tests' fake-model batch, sized and versioned for the report's figures."""
    return fake_model_config(
        **{
            "batch_id": BATCH,
            "environment_options": {"lo": 1, "hi": 8},
            "num_tasks": 8,
            "group_size": 4,
            "sampling": SamplingSettings(temperature=0.8, max_tokens=24),
            "max_in_flight": 8,
            "weight_version": 3,
        }
        | overrides
    )


def summary_of(suite: str, expectations: list[ExpectationOutcome], *, run: int = 0) -> SuiteSummary:
    """A suite run's summary in the validation stage's format."""
    failed = sum(not e.success and e.severity == "fail" for e in expectations)
    warned = sum(not e.success and e.severity == "warn" for e in expectations)
    status = status_of(failed, warned)
    return SuiteSummary(
        suite=suite,
        batch_id=BATCH,
        status=status,
        success=status != "failed",
        expectations=tuple(expectations),
        counts=SummaryCounts(expectations=len(expectations), failed=failed, warned=warned, rows=32),
        thresholds=dataclasses.asdict(ValidationSpec()),
        gx_version="1.24.1",
        report=f"reports/{suite}/run-{run:03d}/index.html",
        created_at=1764628000.0,
        run=f"run-{run:03d}",
        run_key=hashlib.sha256(f"{suite}{run}".encode()).hexdigest(),
        inputs={},
    )


def write_summary(
    root: Path, suite: str, expectations: list[ExpectationOutcome], *, run: int = 0, docs: bool = True
) -> None:
    """A completed run of ``suite`` as the validation stage leaves it (summary and a stand-in for its Data Docs)."""
    folder = root / "batches" / BATCH / "reports" / suite / f"run-{run:03d}"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(summary_of(suite, expectations, run=run).to_json())
    if docs:
        (folder / "index.html").write_text("<html>Data Docs</html>")


def expectation(name: str, *, success: bool = True, severity: str = "fail", **fields: Any) -> ExpectationOutcome:
    return ExpectationOutcome(
        name=name,
        expectation=f"expect_{name}",
        severity=severity,
        success=success,
        observed=fields.get("observed", 0.0),
        threshold=fields.get("threshold"),
        unexpected_count=fields.get("unexpected_count", 0),
        examples=tuple(fields.get("examples", ())),
        error=fields.get("error"),
    )
