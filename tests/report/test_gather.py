"""The figures :func:`gather_report` reads from a real generated and finalized batch (``conftest.py``), checked
against the batch's files read directly (metrics.json as JSON, the dataset's parts with pyarrow)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.layout import REVIEW_RECORD
from tasks.plan import plan_batch
from tasks.publish import record_decision
from tasks.records.review import new_decision
from tasks.report.gather import BatchMetrics, SuiteView, dataset_state, gather_report

from .batches import BATCH, expectation, report_config, summary_of, write_summary


def batch_dir(root: Path) -> Path:
    return root / "batches" / BATCH


def dataset_rows(root: Path) -> pa.Table:
    """Every row of the staged dataset, in part order."""
    return pa.concat_tables(pq.read_table(p) for p in sorted((batch_dir(root) / "dataset").glob("part-*.parquet")))


def test_a_finalized_batch_gives_its_config_dataset_metrics_and_per_row_profile(root):
    figures = gather_report(Batch.open(str(root), BATCH))
    planned = BatchConfig.from_json((batch_dir(root) / "plan/batch.json").read_bytes())
    raw = json.loads((batch_dir(root) / "dataset/metrics.json").read_text())
    rows = dataset_rows(root)

    assert figures.config == planned and figures.dataset_state == "staged" and figures.review is None
    assert figures.manifest.rows == rows.num_rows == 32 and figures.manifest.groups == 8
    metrics = figures.metrics
    assert (metrics.rows, metrics.trainable_rows, metrics.masked_rows) == (
        raw["rows"],
        raw["trainable_rows"],
        raw["masked_rows"],
    )
    assert metrics.masked_rows > 0 and metrics.invalid_reasons == raw["invalid_reasons"]
    assert metrics.failure_reasons == raw["failure_reasons"] and metrics.failure_reasons
    assert (metrics.reward.count, metrics.reward.mean, metrics.reward.max) == (
        raw["reward"]["count"],
        raw["reward"]["mean"],
        raw["reward"]["max"],
    )
    assert metrics.group_weight_versions == tuple(int(v) for v in raw["group_weight_versions"])
    assert metrics.audit is None  # finalized without --audit

    profile = figures.profile
    trainable = rows.column("sample_mask").to_numpy() == 1
    assert profile.rows == 32 and np.array_equal(profile.trainable, trainable)
    assert np.array_equal(profile.num_turns, rows.column("num_turns").to_numpy())
    assert int(profile.lengths.sum()) == raw["tokens"] == pc.sum(pc.list_value_length(rows["input_ids"])).as_py()
    assert profile.stride == 1 and [g.group_id for g in profile.group_rewards] == [f"g{i:06d}" for i in range(8)]
    assert sum(len(g.trainable) for g in profile.group_rewards) == int(trainable.sum())
    assert sum(len(g.masked) + g.unrewarded for g in profile.group_rewards) == int((~trainable).sum())
    assert set(profile.versions) == {3, 5, None}
    lows, highs = rows["weight_version_min"].to_pylist(), rows["weight_version_max"].to_pylist()
    assert profile.version_min == {v: lows.count(v) for v in set(lows)}
    assert profile.spanning_rows == sum(a != b for a, b in zip(lows, highs, strict=True)) > 0

    assert [(view.suite, view.status) for view in figures.suites] == [("lineage", "not run"), ("dataset", "not run")]
    assert figures.verdict == "not run" and figures.problems == []
    assert figures.sources == ["plan/batch.json", "dataset/_STAGED.json", "dataset/metrics.json"]


def test_suite_runs_their_data_docs_pages_and_the_review_are_gathered(root):
    pages = batch_dir(root) / "reports/dataset/run-000/validations/dataset.rows/x"
    write_summary(root, "lineage", [expectation("call_ids_unique")])
    write_summary(
        root,
        "dataset",
        [
            expectation("lengths_equal", success=False, examples=["r000001-00"]),
            expectation("reward_range", success=False, severity="warn"),
            expectation("advantage_finite", success=False),
        ],
    )
    pages.mkdir(parents=True)
    for table in ("rows", "shards", "unknown"):
        (pages / f"dataset-{table}.html").write_text("<html></html>")

    figures = gather_report(Batch.open(str(root), BATCH))
    lineage, dataset = figures.suites
    assert lineage == SuiteView("lineage", summary_of("lineage", [expectation("call_ids_unique")]), docs=True)
    assert (dataset.status, dataset.docs) == ("failed", True)
    assert dataset.pages == (  # in the suite's table order; a page of no table of the suite is left out
        ("shards", "reports/dataset/run-000/validations/dataset.rows/x/dataset-shards.html"),
        ("rows", "reports/dataset/run-000/validations/dataset.rows/x/dataset-rows.html"),
    )
    assert figures.verdict == "failed" and figures.dataset_state == "staged"
    assert [(suite, e.name) for suite, e in figures.problems] == [
        ("dataset", "advantage_finite"),
        ("dataset", "lengths_equal"),
        ("dataset", "reward_range"),  # warned: after every failure
    ]

    rejected = new_decision(BATCH, "reject", "too many masked rows", decided_by="alice", via="cli")
    record_decision(Batch.open(str(root), BATCH), rejected)
    figures = gather_report(Batch.open(str(root), BATCH))
    assert figures.review == rejected and figures.dataset_state == "rejected"
    assert figures.sources[-3:] == [
        REVIEW_RECORD,
        "reports/lineage/run-000/summary.json",
        "reports/dataset/run-000/summary.json",
    ]


def test_unreadable_summaries_and_review_records_are_kept_as_their_errors(root):
    (batch_dir(root) / "reports/lineage/run-000").mkdir(parents=True)
    (batch_dir(root) / "reports/lineage/run-000/summary.json").write_text('{"suite": "lineage"}')
    (batch_dir(root) / REVIEW_RECORD).write_text("[1, 2]")
    figures = gather_report(Batch.open(str(root), BATCH))
    assert figures.suites[0].status == "unreadable" and "summary.json" in figures.suites[0].error
    assert isinstance(figures.review, str) and REVIEW_RECORD in figures.review
    assert figures.verdict == "unreadable" and figures.dataset_state == "staged"


def test_a_batch_only_planned_has_no_dataset_figures(tmp_path):
    config = report_config()
    plan_batch(Batch.open(str(tmp_path), config.batch_id), config)
    figures = gather_report(Batch.open(str(tmp_path), BATCH))
    assert (figures.manifest, figures.metrics, figures.profile) == (None, None, None)
    assert figures.dataset_state == "not built" and figures.sources == ["plan/batch.json"]


def test_the_figures_are_read_from_object_storage_too(root):
    fsspec = pytest.importorskip("fsspec")
    memory = fsspec.filesystem("memory")
    memory.put(str(root), "/gather-root", recursive=True)
    try:
        remote = gather_report(Batch.open("memory://gather-root", BATCH))
        local = gather_report(Batch.open(str(root), BATCH))
        assert remote.metrics == local.metrics and remote.config == local.config
        assert np.array_equal(remote.profile.lengths, local.profile.lengths)
    finally:
        memory.rm("/gather-root", recursive=True)
    assert Batch.open(str(root), BATCH).store.exists("dataset/metrics.json")


def test_metrics_without_a_figure_leave_it_none():
    metrics = BatchMetrics.of({"rows": 4, "reward": "not a summary", "invalid_reasons": [1], "audit": None})
    assert metrics.rows == 4 and metrics.receipts is None and metrics.reward.mean is None
    assert metrics.invalid_reasons == {} and metrics.audit is None and metrics.group_weight_versions == ()


@pytest.mark.parametrize(
    ("published", "staged", "review", "statuses", "state"),
    [
        (True, True, "rejected", ("failed",), "published"),
        (False, True, "approved", ("warned",), "approved"),
        (False, True, "rejected", ("warned",), "rejected"),
        (False, False, None, (), "not built"),
        (False, True, None, ("passed", "warned"), "awaiting review"),
        (False, True, None, ("warned", "not run"), "staged"),
        (False, True, None, ("failed", "warned"), "staged"),
    ],
)
def test_the_dataset_state(published, staged, review, statuses, state):
    choice = {"approved": "publish", "rejected": "reject"}.get(review)
    decision = new_decision(BATCH, choice, "why", decided_by="alice", via="cli") if choice else None
    failing = {
        "passed": [],
        "warned": [expectation("w", success=False, severity="warn")],
        "failed": [expectation("f", success=False)],
    }
    suites = [SuiteView("dataset", summary_of("dataset", failing[s]) if s != "not run" else None) for s in statuses]
    assert dataset_state(published, staged, decision, suites) == state
