"""The dataset suite's off-policy expectations: a NaN logprob or a missing sampling mask fails the batch, a ratio,
bound, diagnosis or staleness breach warns (the batch waits for review), and a batch without an audit passes.

The measures come from an audit report's ``off_policy`` object (hand-made here; the gate's own
figures are tested in tests/finalize/test_off_policy.py) through the profile's ``off_policy`` table.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tasks.config import ValidationSpec
from tasks.records.suite_summary import DATASET
from tasks.validate.dataset_profile import off_policy_profile
from tasks.validate.gx_run import run_gx_suite
from tasks.validate.suites import DATASET_TABLES, SuiteSpec, dataset_suite, off_policy_expectations

CLEAN: dict[str, Any] = {
    "planned_weight_version": 0,
    "tokens": 500,
    "sequences": 8,
    "nan_tokens": 0,
    "missing_mask_tokens": 0,
    "kept_mass_mean": 0.887,
    "ratios": {
        "kept_set": {"token_mean": 1.0004, "geometric_mean": 0.9999},
        "full_vocab": {"token_mean": 0.887, "geometric_mean": 0.86},
    },
    "tokens_outside_bound": 0,
    "sequences_outside_bound": 0,
    "staleness": {"max": 0, "mean": 0.0, "tokens_by_versions_behind": {"0": 500}},
    "flagged_rows": [],
}


def _off_policy_suite(thresholds: ValidationSpec) -> SuiteSpec:
    table = next(t for t in DATASET_TABLES if t.name == "off_policy")
    return SuiteSpec(
        name=DATASET, tables=(table,), expectations=tuple(off_policy_expectations(thresholds)), rows_table="off_policy"
    )


def _failing(off_policy: dict[str, Any] | None, tmp_path, thresholds: ValidationSpec | None = None) -> dict[str, str]:
    """Expectation name -> severity of each off-policy expectation the measures break."""
    thresholds = thresholds or ValidationSpec()
    suite = _off_policy_suite(thresholds)
    results = run_gx_suite(
        suite, {"off_policy": off_policy_profile("b-gate", off_policy)}, site_dir=tmp_path / "docs", run_name="run"
    )
    severity = {spec.name: spec.severity for spec in suite.expectations}
    return {name: severity[name] for name, result in results.items() if not result.success}


def _with(**changes: Any) -> dict[str, Any]:
    off_policy = copy.deepcopy(CLEAN)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        target = off_policy
        for key in parents:
            target = target[key]
        target[leaf] = value
    return off_policy


@pytest.mark.parametrize(
    ("case", "changes", "expected"),
    [
        ("clean", {}, {}),
        ("nan", {"nan_tokens": 1}, {"off_policy_no_nan_logprobs": "fail"}),
        ("missing mask", {"missing_mask_tokens": 16}, {"off_policy_masks_present": "fail"}),
        ("kept ratio", {"ratios__kept_set__token_mean": 1.08}, {"off_policy_kept_ratio_mean": "warn"}),
        ("geometric", {"ratios__kept_set__geometric_mean": 0.9}, {"off_policy_kept_geometric_mean": "warn"}),
        ("bound", {"tokens_outside_bound": 6}, {"off_policy_tokens_within_bound": "warn"}),
        ("stale", {"staleness__max": 1}, {"off_policy_staleness": "warn"}),
        (
            "diagnosed",
            {"flagged_rows": [{"rollout_id": "r1", "reasons": ["temperature_mismatch"], "tokens": []}]},
            {"off_policy_rows_explained": "warn"},
        ),
    ],
)
def test_nan_and_missing_masks_fail_and_every_other_breach_warns(case, changes, expected, tmp_path) -> None:
    assert _failing(_with(**changes), tmp_path) == expected


def test_the_full_vocabulary_ratio_is_reported_not_bounded(tmp_path) -> None:
    """Under top-p the full-vocabulary ratio is the kept mass (0.887 here): a fact about truncation, not a fault."""
    assert _failing(_with(ratios__full_vocab__token_mean=0.5), tmp_path) == {}


def test_a_batch_finalized_without_the_audit_passes_every_off_policy_expectation(tmp_path) -> None:
    table = off_policy_profile("b-gate", None)
    assert table.num_rows == 1 and all(table[name][0].as_py() is None for name in table.column_names[1:])
    assert _failing(None, tmp_path) == {}


def test_the_thresholds_are_the_batch_configs(tmp_path) -> None:
    loose = ValidationSpec(off_policy_max_staleness=2, off_policy_max_ratio_deviation=0.1)
    assert _failing(_with(staleness__max=2, ratios__kept_set__token_mean=1.08), tmp_path, loose) == {}
    specs = {spec.name: spec for spec in dataset_suite(loose, on_invalid="mask").expectations}
    assert specs["off_policy_staleness"].threshold == 2
    assert specs["off_policy_kept_ratio_mean"].threshold_field == "off_policy_max_ratio_deviation"
    assert [name for name in specs if name.startswith("off_policy_")] == [
        "off_policy_no_nan_logprobs",
        "off_policy_masks_present",
        "off_policy_kept_ratio_mean",
        "off_policy_kept_geometric_mean",
        "off_policy_tokens_within_bound",
        "off_policy_rows_explained",
        "off_policy_staleness",
    ]
