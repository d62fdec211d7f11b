"""Both suites on a clean generated and finalized batch: everything passes, reports land, re-runs are safe."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.batch import Batch
from tasks.config import ValidationSpec
from tasks.errors import MalformedSummaryError, NothingToValidateError
from tasks.plan import plan_batch
from tasks.report import write_report_index
from tasks.validate import SuiteOutcome, validate_dataset, validate_lineage
from tasks.validate.suites import DATASET_TABLES, LINEAGE_TABLES
from tests.local_batch import LocalBatch, copy_batch

from .conftest import validation_config

# The documented summary.json format: these keys, in this order (fields are only ever added).
SUMMARY_KEYS = [
    "suite",
    "batch_id",
    "status",
    "success",
    "expectations",
    "counts",
    "thresholds",
    "gx_version",
    "report",
    "created_at",
    "run",
    "run_key",
    "inputs",
]
EXPECTATION_KEYS = [
    "name",
    "expectation",
    "severity",
    "success",
    "observed",
    "threshold",
    "unexpected_count",
    "examples",
    "error",
]


@pytest.fixture(scope="module")
def validated(
    finalized_batch: LocalBatch, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LocalBatch, dict[str, SuiteOutcome]]:
    """A copy of the clean batch with both suites run once, from a working directory that must stay empty."""
    batch = copy_batch(finalized_batch, tmp_path_factory.mktemp("clean"))
    cwd = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        outcomes = {
            "lineage": validate_lineage(batch.handle),
            "dataset": validate_dataset(batch.handle),
        }
    assert list(cwd.iterdir()) == [], "validation wrote into the working directory (a gx/ folder?)"
    return batch, outcomes


def test_clean_batch_passes_both_suites(validated):
    batch, outcomes = validated
    for suite, outcome in outcomes.items():
        summary = outcome.summary
        assert (outcome.status, outcome.success, outcome.created) == ("passed", True, True), suite
        assert [e.name for e in summary.expectations if not e.success] == [], suite
        assert all(e.error is None and e.examples == () and e.unexpected_count == 0 for e in summary.expectations)
        assert summary.counts.expectations == len(summary.expectations) and summary.counts.failed == 0
        assert ValidationSpec.of_recorded(summary.thresholds) == batch.config.validation
        assert summary.gx_version == "1.24.1"
    assert outcomes["lineage"].summary.counts.rows > batch.config.num_rollouts  # call records: several turns each
    assert outcomes["dataset"].summary.counts.rows == batch.config.num_rollouts


def test_reports_are_written_under_the_run_directory(validated):
    batch, outcomes = validated
    for suite, outcome in outcomes.items():
        assert outcome.summary_path == f"reports/{suite}/run-000/summary.json"
        assert outcome.summary.report == f"reports/{suite}/run-000/index.html"
        assert outcome.report_url == f"{batch.store.url}/reports/{suite}/run-000/index.html"
        assert (batch.dir / outcome.summary.report).is_file()
        pages = sorted(p.name for p in (batch.dir / f"reports/{suite}/run-000/validations").rglob("*.html"))
        tables = {"lineage": LINEAGE_TABLES, "dataset": DATASET_TABLES}[suite]
        assert pages == sorted(f"{suite}-{table.name}.html" for table in tables)
    assert not [p for p in batch.root.rglob("gx") if p.is_dir()]


def test_the_overview_links_each_tables_validation_page(validated):
    """Offline, the Data Docs index lists nothing (its table is drawn by CDN scripts): the overview links every page."""
    batch, _ = validated
    page = (batch.dir / write_report_index(batch.handle)).read_text()
    for suite, tables in (("lineage", LINEAGE_TABLES), ("dataset", DATASET_TABLES)):
        for table in tables:
            pattern = rf'<a href="({suite}/run-000/validations/[^"]+/{suite}-{table.name}\.html)">{table.name}</a>'
            links = re.findall(pattern, page)
            assert len(links) == 1, (suite, table.name)
            assert (batch.dir / "reports" / links[0]).is_file()


def test_summary_json_keeps_the_documented_format(validated):
    batch, outcomes = validated
    for suite, outcome in outcomes.items():
        raw = json.loads((batch.dir / outcome.summary_path).read_text())
        assert list(raw) == SUMMARY_KEYS
        assert [list(e) for e in raw["expectations"]] == [EXPECTATION_KEYS] * len(raw["expectations"])
        assert list(raw["counts"]) == ["expectations", "failed", "warned", "rows"]
        assert raw["thresholds"] == dataclasses.asdict(batch.config.validation)
        assert batch.handle.suite_summary(suite) == outcome.summary


def test_rerunning_with_the_same_inputs_is_a_no_op(validated):
    batch, outcomes = validated
    again = validate_lineage(batch.handle)
    assert again.created is False and again.summary == outcomes["lineage"].summary
    assert sorted(p.name for p in (batch.dir / "reports/lineage").iterdir()) == ["run-000"]


def test_rerunning_with_other_thresholds_makes_a_new_current_run(finalized_batch, tmp_path):
    batch = copy_batch(finalized_batch, tmp_path)
    first = validate_dataset(batch.handle)
    relaxed = ValidationSpec(max_invalid_row_rate=0.5)
    second = validate_dataset(batch.handle, thresholds=relaxed)
    assert (first.summary.run, second.summary.run, second.created) == ("run-000", "run-001", True)
    assert batch.handle.suite_summary("dataset") == second.summary
    assert ValidationSpec.of_recorded(second.summary.thresholds) == relaxed
    assert (batch.dir / "reports/dataset/run-000/summary.json").is_file()  # the first run's files stay


def test_a_run_that_crashed_before_its_summary_is_not_current(finalized_batch, tmp_path):
    batch = copy_batch(finalized_batch, tmp_path)
    (batch.dir / "reports/lineage/run-000").mkdir(parents=True)
    (batch.dir / "reports/lineage/run-000/_CLAIM.json").write_text("{}")
    assert batch.handle.suite_summary("lineage") is None
    outcome = validate_lineage(batch.handle)
    assert outcome.summary.run == "run-001" and batch.handle.suite_summary("lineage") == outcome.summary


def test_a_malformed_summary_is_refused_naming_the_file(validated, tmp_path):
    batch = copy_batch(validated[0], tmp_path)
    path = batch.dir / "reports/lineage/run-000/summary.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "status": "fine"}))
    with pytest.raises(MalformedSummaryError, match=r"run-000/summary.json.*status"):
        batch.handle.suite_summary("lineage")
    path.write_text(json.dumps({k: v for k, v in raw.items() if k != "counts"}))
    with pytest.raises(MalformedSummaryError, match=r"missing field\(s\) \['counts'\]"):
        batch.handle.suite_summary("lineage")


def test_a_batch_without_committed_shards_or_staged_dataset_is_refused(generated_batch, tmp_path):
    root = tmp_path / "planned-only"
    config = validation_config(batch_id="b-planned-only")
    plan_batch(Batch.open(str(root), config.batch_id), config)
    with pytest.raises(NothingToValidateError, match="none of its 2 shard"):
        validate_lineage(Batch.open(str(root), config.batch_id))
    with pytest.raises(NothingToValidateError, match="no staged dataset"):
        validate_dataset(generated_batch.handle)


def test_importing_the_package_does_not_import_great_expectations():
    code = "import sys, tasks.validate; print('great_expectations' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    )
    assert out.stdout.strip() == "False"
