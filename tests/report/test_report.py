"""The overview page ``reports/index.html``: rendered from a real generated and finalized batch
(fake scripted engine, real tokenizer and storage; ``conftest.py``) plus hand-written suite summaries."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import html
import json
import re
from pathlib import Path

import pytest

from tasks.batch import Batch
from tasks.finalize.logprob_audit import AuditReport
from tasks.plan import plan_batch
from tasks.report import INDEX, gather, write_report_index
from tasks.report.charts import nice_ticks
from tasks.report.gather import AuditFigures, SuiteView, gather_report, overall_status
from tasks.report.render import docs_link, render_report

from .batches import BATCH, HOSTILE, expectation, report_config, summary_of, write_summary


def svg_count(page: str) -> int:
    return page.count("<svg")


def read_page(root: Path, path: str = INDEX) -> str:
    return (root / "batches" / BATCH / path).read_text(encoding="utf-8")


def test_the_page_shows_headline_numbers_suites_with_links_and_one_svg_per_plot(root):
    write_summary(root, "lineage", [expectation("call_ids_unique"), expectation("cum_len_adds_up")])
    write_summary(
        root,
        "dataset",
        [
            expectation("lengths_equal"),
            expectation(
                "invalid_row_rate",
                success=False,
                observed=0.25,
                threshold=0.05,
                unexpected_count=8,
                examples=["r000001-00", HOSTILE],
            ),
            expectation("reward_range", success=False, severity="warn", threshold=[0.0, 0.9], unexpected_count=1),
        ],
    )
    path = write_report_index(Batch.open(str(root), BATCH))
    assert path == INDEX == "reports/index.html"
    page = read_page(root)
    metrics = json.loads((root / "batches" / BATCH / "dataset" / "metrics.json").read_text())
    assert metrics["masked_rows"] > 0 and metrics["failure_reasons"], "the fixture should mask some rollouts"

    assert "<h1>Batch b-report" in page and "validation failed" in page and "staged" in page
    for label, value in [
        ("Rollouts planned", metrics["planned_rollouts"]),
        ("Receipted", metrics["receipts"]),
        ("Trainable rows", metrics["trainable_rows"]),
        ("Masked rows", metrics["masked_rows"]),
        ("Tokens", metrics["tokens"]),
    ]:
        assert re.search(rf">{label}</div><div class=\"value\">{value:,}</div>", page), label
    assert f">{metrics['reward']['mean']:,.4g}<" in page
    assert ">3–5<" in page  # weight versions
    for reason, count in metrics["invalid_reasons"].items():
        assert f"{reason} {count}" in page
    assert "fake-model" in page

    assert 'href="lineage/run-000/index.html"' in page and 'href="dataset/run-000/index.html"' in page
    assert '<span class="badge passed">passed</span>' in page and '<span class="badge failed">failed</span>' in page
    assert "invalid_row_rate" in page and "<code>r000001-00</code>" in page and "reward_range" in page

    assert svg_count(page) == 5  # rewards, turns, lengths, reasons, weight versions; the audit did not run
    assert "Logprob audit" in page and "not run: finalize ran without --audit" in page
    assert "<script" not in page.lower() and "http://" not in page and "https://" not in page
    assert HOSTILE not in page and html.escape(HOSTILE) in page
    assert not re.search(r"\sstyle=", page) and "<link" not in page and "@import" not in page

    versions = sorted((root / "batches" / BATCH / "reports").glob("index-*.html"))
    assert len(versions) == 1 and versions[0].read_text(encoding="utf-8") == page


def test_the_page_allows_its_only_style_sheet_by_hash_in_its_own_policy(root):
    page = read_page(root, write_report_index(Batch.open(str(root), BATCH)))
    (style,) = re.findall(r"<style>(.*?)</style>", page, re.S)
    digest = base64.b64encode(hashlib.sha256(style.encode()).digest()).decode()
    policy = html.unescape(re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page).group(1))
    assert policy.startswith("default-src 'none'; ") and f"style-src 'sha256-{digest}'" in policy


def test_a_missing_suite_and_a_missing_dataset_show_as_not_run(root, tmp_path):
    write_summary(root, "lineage", [expectation("terminal_declared", success=False, severity="warn")], docs=False)
    page = read_page(root, write_report_index(Batch.open(str(root), BATCH)))
    assert '<span class="badge warned">warned</span>' in page and '<span class="badge not-run">not run</span>' in page
    assert "not run: no completed run under <code>reports/dataset/</code>" in page and "not validated" in page
    assert "no Data Docs at reports/lineage/run-000/index.html" in page

    planned_only = tmp_path / "planned"
    config = report_config()
    plan_batch(Batch.open(str(planned_only), config.batch_id), config)
    page = read_page(planned_only, write_report_index(Batch.open(str(planned_only), BATCH)))
    assert page.count('<span class="badge not-run">not run</span>') == 2
    assert (
        "not built" in page and page.count("not run: the dataset has not been staged") == 7
    )  # five plots, the audit, the gate
    assert '>Rollouts planned</div><div class="value">32</div>' in page
    assert svg_count(page) == 0


def test_an_unreadable_summary_is_shown_not_raised(root):
    folder = root / "batches" / BATCH / "reports" / "dataset" / "run-000"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text("{not json")
    page = read_page(root, write_report_index(Batch.open(str(root), BATCH)))
    assert '<span class="badge unreadable">unreadable</span>' in page and "validation unreadable" in page
    assert "unreadable: " in page and "run-000/summary.json" in page


def test_a_rerun_replaces_the_page_and_keeps_each_distinct_version(root):
    reports = root / "batches" / BATCH / "reports"
    write_summary(root, "lineage", [expectation("parents_resolve", success=False, examples=["x"])])
    first = read_page(root, write_report_index(Batch.open(str(root), BATCH)))
    write_report_index(Batch.open(str(root), BATCH))  # same inputs: same bytes, nothing new
    assert len(list(reports.glob("index-*.html"))) == 1

    write_summary(root, "lineage", [expectation("parents_resolve")], run=1)
    second = read_page(root, write_report_index(Batch.open(str(root), BATCH)))
    assert "validation failed" in first and "run-001" in second and '<span class="badge passed">passed</span>' in second
    assert sorted(p.read_text(encoding="utf-8") for p in reports.glob("index-*.html")) == sorted([first, second])
    assert not [p for p in reports.iterdir() if p.name.startswith(".tmp-")]


def test_the_audit_plot_is_drawn_from_the_audit_statistics(root):
    figures = gather_report(Batch.open(str(root), BATCH))
    audit = AuditReport(
        model_path="/models/smollm2",
        temperature=0.8,
        top_p=1.0,
        top_k=-1,
        sample_size=32,
        seed=0,
        rows_eligible=20,
        rows_audited=16,
        tokens_audited=400,
        filtered_out_tokens=1,
        mean_abs_diff=0.0021,
        max_abs_diff=0.09,
        p99_abs_diff=0.03,
        raw_mean_abs_diff=0.4,
        clip_low=0.5,
        clip_high=2.0,
        token_ratio_mean=1.001,
        token_ratio_min=0.91,
        token_ratio_max=1.09,
        tokens_outside_clip=0,
        token_outside_clip_fraction=0.0,
        seq_log_ratio_mean=0.01,
        seq_ratio_mean=1.01,
        seq_ratio_min=0.7,
        seq_ratio_max=2.6,
        sequences_outside_clip=1,
        seq_outside_clip_fraction=1 / 16,
    ).to_dict()
    page = render_report(
        dataclasses.replace(figures, metrics=dataclasses.replace(figures.metrics, audit=AuditFigures.of(audit)))
    )
    assert svg_count(page) == 6 and "not run: finalize ran without --audit" not in page
    assert "16 of 20 eligible" in page and "0.0021" in page and "clip 0.5" in page and "/models/smollm2" in page


def test_the_reward_plot_samples_evenly_spaced_groups_of_a_large_batch(root, monkeypatch):
    monkeypatch.setattr(gather, "MAX_GROUPS_SHOWN", 3)
    profile = gather_report(Batch.open(str(root), BATCH)).profile
    assert [g.group_id for g in profile.group_rewards] == ["g000000", "g000003", "g000006"]
    assert profile.groups == 8 and profile.rows == 32 == profile.lengths.size == profile.num_turns.size
    assert sum(len(g.trainable) for g in profile.group_rewards) <= 12
    assert set(profile.version_min) | set(profile.version_max) == {3, 5, None}  # None: not linearized
    assert profile.version_min[None] == profile.rows - int(profile.trainable.sum())


@pytest.mark.parametrize(
    ("statuses", "verdict"),
    [
        (("passed", "passed"), "passed"),
        (("passed", "warned"), "warned"),
        (("warned", None), "not run"),
        (("failed", None), "failed"),
        ((None, None), "not run"),
    ],
)
def test_the_verdict_is_the_worst_suite_status(statuses, verdict):
    failing = {
        "passed": [],
        "warned": [expectation("w", success=False, severity="warn")],
        "failed": [expectation("f", success=False)],
    }
    suites = [
        SuiteView(suite, None if status is None else summary_of(suite, failing[status]))
        for suite, status in zip(("lineage", "dataset"), statuses, strict=True)
    ]
    assert [view.status for view in suites] == [status or "not run" for status in statuses]
    assert overall_status(suites) == verdict


def test_docs_links_are_relative_to_the_page():
    assert docs_link("reports/lineage/run-002/index.html") == "lineage/run-002/index.html"
    assert docs_link("javascript:alert(1)") == "../javascript:alert(1)"


def test_nice_ticks_cover_the_range_with_round_steps():
    assert nice_ticks(0, 1) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 37) == [0, 10, 20, 30, 40]
    assert nice_ticks(-0.3, 0.9)[0] <= -0.3 and nice_ticks(-0.3, 0.9)[-1] >= 0.9
    assert nice_ticks(5, 5) == [5, 5.2, 5.4, 5.6, 5.8, 6.0]


def test_the_page_is_written_and_replaced_on_object_storage_without_local_files(root):
    fsspec = pytest.importorskip("fsspec")
    memory = fsspec.filesystem("memory")
    memory.put(str(root), "/report-root", recursive=True)
    url = "memory://report-root"
    try:
        assert write_report_index(Batch.open(url, BATCH)) == INDEX
        first = memory.cat_file(f"/report-root/batches/{BATCH}/{INDEX}").decode()
        memory.pipe_file(
            f"/report-root/batches/{BATCH}/reports/lineage/run-000/summary.json",
            summary_of("lineage", [expectation("call_ids_unique")]).to_json().encode(),
        )
        write_report_index(Batch.open(url, BATCH))
        second = memory.cat_file(f"/report-root/batches/{BATCH}/{INDEX}").decode()
        assert "not validated" in first and '<span class="badge passed">passed</span>' in second
        assert len(memory.glob(f"/report-root/batches/{BATCH}/reports/index-*.html")) == 2
    finally:
        memory.rm("/report-root", recursive=True)
