"""The GX runner turns an expectation that raises into a failed result carrying GX's message."""

from __future__ import annotations

import pyarrow as pa

from tasks.validate.gx_run import run_suite
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
    results = run_suite(suite, {"calls": pa.table({"call_id": ["a", "b", "b"]})}, site_dir=tmp_path, run_name="run-000")
    assert not results["broken"].success and results["broken"].error == (
        'Error: The column "no_such_column" in BatchData does not exist.'
    )
    assert (results["unique"].success, results["unique"].examples, results["unique"].unexpected_count) == (
        False,
        ("b",),
        2,
    )
    assert results["unique"].error is None
