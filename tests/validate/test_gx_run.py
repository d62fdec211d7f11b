"""The GX runner: an expectation that raises is a failed result carrying GX's message; offending rows are capped."""

from __future__ import annotations

import pyarrow as pa

from tasks.validate.gx_run import MAX_EXAMPLES, run_gx_suite
from tasks.validate.suites import ExpectationSpec, SuiteSpec, TableSpec


def test_an_expectation_that_raises_fails_with_its_error_and_the_others_still_run(tmp_path):
    table = TableSpec("calls", "call_id", "call records")
    broken = ExpectationSpec(
        name="broken",
        table="calls",
        expectation="expect_column_values_to_match_regex",
        kwargs={"column": "no_such_column", "regex": "x"},
        severity="fail",
        rule="A rule over a column the profile does not have.",
    )
    unique = ExpectationSpec(
        name="unique",
        table="calls",
        expectation="expect_column_values_to_be_unique",
        kwargs={"column": "call_id"},
        severity="warn",
        rule="Call ids do not repeat.",
    )
    suite = SuiteSpec(name="lineage", tables=(table,), expectations=(broken, unique), rows_table="calls")
    results = run_gx_suite(
        suite, {"calls": pa.table({"call_id": ["a", "b", "b"]})}, site_dir=tmp_path, run_name="run-000"
    )
    assert not results["broken"].success and results["broken"].error == (
        'Error: The column "no_such_column" in BatchData does not exist.'
    )
    assert (results["unique"].success, results["unique"].examples, results["unique"].unexpected_count) == (
        False,
        ("b",),
        2,
    )
    assert results["unique"].error is None


def test_a_rule_broken_by_many_rows_counts_them_all_and_names_the_first_few(tmp_path):
    table = TableSpec("model_calls", "call_id", "model calls")
    rate = ExpectationSpec(
        name="failure_row_rate",
        table="model_calls",
        expectation="expect_column_values_to_be_in_set",
        kwargs={"column": "failed", "value_set": [False], "mostly": 0.9},
        severity="warn",
        rule="At most a tenth of the model calls failed.",
    )
    suite = SuiteSpec(name="lineage", tables=(table,), expectations=(rate,), rows_table="model_calls")
    ids = [f"c{i:03d}" for i in range(100)]
    profile = pa.table({"call_id": ids, "failed": [i % 2 == 1 for i in range(100)]})
    (result,) = run_gx_suite(suite, {"model_calls": profile}, site_dir=tmp_path, run_name="run-000").values()
    assert (result.success, result.checked, result.unexpected_count) == (False, 100, 50)
    assert result.examples == tuple(ids[1 : 2 * MAX_EXAMPLES : 2])


def test_weight_versions_are_compared_as_numbers_at_both_ends_of_uint64(tmp_path):
    table = TableSpec("calls", "call_id", "call records")
    spec = ExpectationSpec(
        name="weight_versions_at_least_planned",
        table="calls",
        expectation="expect_column_values_to_be_between",
        kwargs={"column": "weight_version", "min_value": 2},
        severity="fail",
        rule="No call is older than version 2.",
    )
    suite = SuiteSpec(name="lineage", tables=(table,), expectations=(spec,), rows_table="calls")
    for versions, old in (([1, 2, 2**63 - 1], ("a",)), ([1, 2, 2**64 - 1], ("a",)), ([2, 3, 2**64 - 1], ())):
        profile = pa.table({"call_id": ["a", "b", "c"], "weight_version": pa.array(versions, pa.uint64())})
        (result,) = run_gx_suite(
            suite, {"calls": profile}, site_dir=tmp_path / str(versions), run_name="run-000"
        ).values()
        assert (result.success, result.examples) == (not old, old), versions
