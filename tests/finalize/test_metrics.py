"""Batch metrics: rates, reason families, terminal selection fractions, group outcomes."""

from __future__ import annotations

import json

import pytest

from tasks.finalize.metrics import DatasetMetrics, reason_prefix

from .rollouts import assemble, batch_config, make_rollout, mixed_groups, rows_of


@pytest.fixture
def metrics() -> DatasetMetrics:
    accumulator = DatasetMetrics()
    for group in mixed_groups(batch_config()):
        accumulator.add_groups(group)
    return accumulator


def test_invalid_row_rate_counts_masked_and_missing_rollouts_over_planned(metrics):
    result = metrics.result()
    assert (result["planned_rollouts"], result["receipts"], result["missing_receipts"]) == (12, 11, 1)
    assert result["invalid_row_rate"] == 2 / 12
    assert result["invalid_reasons"] == {"capture_poisoned": 1, "missing_receipt": 1}
    assert result["capture_poisoned_rollouts"] == 1
    assert (result["rows"], result["trainable_rows"], result["masked_rows"]) == (12, 10, 2)


def test_terminal_selection_fractions_are_over_receipts(metrics):
    result = metrics.result()
    assert result["terminal_selection_declared"] == 10 / 11
    assert result["terminal_selection_heuristic"] == 1 / 11
    assert result["terminal_selection_content"] == 0.0 and result["terminal_selection_none"] == 0.0


def test_ledger_rates_are_none_until_ledger_counts_are_added(metrics):
    assert metrics.result()["calls_per_rollout"] is None and metrics.result()["token_in_rate"] is None
    metrics.add_ledger(calls=20, token_in_calls=9, failure_reasons={"staging_write_failed": 2, "prefix_mismatch": 1})
    metrics.add_ledger(calls=2, token_in_calls=1, failure_reasons={"staging_timeout": 1})
    result = metrics.result()
    assert result["calls_per_rollout"] == 22 / 11 and result["token_in_rate"] == 10 / 22
    assert result["failure_reasons_by_prefix"] == {"prefix": 1, "staging": 3}


def test_ledger_counts_that_contradict_each_other_are_refused():
    with pytest.raises(ValueError, match=r"token_in_calls \(3\) exceeds calls \(2\)"):
        DatasetMetrics().add_ledger(calls=2, token_in_calls=3, failure_reasons={})


def test_group_outcomes_and_weight_versions_are_counted(metrics):
    result = metrics.result()
    assert result["groups"] == 3
    assert (result["groups_dropped"], result["groups_zero_variance"], result["groups_single_valid"]) == (0, 0, 0)
    assert result["group_weight_versions"] == {"0": 3}


def test_token_and_length_statistics_cover_the_rows(metrics):
    groups = mixed_groups(batch_config())
    rows = [r for g in groups for r in rows_of(g)]
    result = metrics.result()
    assert result["tokens"] == sum(r.input_ids.size for r in rows)
    assert result["sampled_tokens"] == sum(int(r.loss_mask.sum()) for r in rows if r.sample_mask)
    assert result["row_length"]["max"] == max(r.input_ids.size for r in rows)
    assert result["reward"]["count"] == 10 and result["reward"]["mean"] == pytest.approx(0.5)


def test_empty_batch_has_no_nan_and_serializes(metrics):
    result = DatasetMetrics().result()
    assert result["invalid_row_rate"] is None and result["reward"]["mean"] is None
    json.dumps(result, allow_nan=False)
    json.dumps(metrics.result(), allow_nan=False)


def test_epoch_spans_are_summed_over_rollouts():
    accumulator = DatasetMetrics()
    group = assemble([make_rollout(0, 0, epoch_span_count=2), make_rollout(0, 1, epoch_span_count=1)], group_size=2)
    accumulator.add_groups(group)
    assert accumulator.result()["epoch_span_count"] == 3


def test_reason_family_is_the_text_before_the_first_underscore():
    assert reason_prefix("staging_write_failed") == "staging" and reason_prefix("timeout") == "timeout"
