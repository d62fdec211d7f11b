"""Group assembly (docs/architecture.md §8): masking, dropping, advantages, group stats, row order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.finalize import reasons
from tasks.finalize.assemble import assemble_rows

from .rollouts import (
    BATCH_ID,
    UNVERIFIED_PLAN,
    assemble,
    batch_config,
    make_rollout,
    mixed_groups,
    mixed_rollouts,
    planned_ids,
    rows_of,
)
from .verdicts import columns_of


def test_mask_mode_yields_group_size_rows_with_invalid_and_missing_masked():
    verified = [
        make_rollout(sample=0, reward=1.0),
        make_rollout(sample=1, reward=0.0),
        make_rollout(sample=3, reward=1.0, reason=reasons.CAPTURE_POISONED),
    ]
    result = assemble(verified)
    rows, stats = rows_of(result), result.groups[0]
    assert [r.rollout_id for r in rows] == planned_ids(0, 4)
    assert [r.sample_mask for r in rows] == [1, 1, 0, 0]
    assert [r.mask_reason for r in rows] == [None, None, reasons.MISSING_RECEIPT, reasons.CAPTURE_POISONED]
    assert [r.group_size for r in rows] == [4] * 4
    assert rows[2].input_ids.size == 0 and rows[2].reward is None
    assert stats.missing == 1 and stats.valid == 2
    assert dict(stats.invalid_reasons) == {reasons.MISSING_RECEIPT: 1, reasons.CAPTURE_POISONED: 1}


def test_masked_row_keeps_verified_tokens_when_linearized_and_has_zero_advantage():
    poisoned = make_rollout(sample=2, reward=5.0, reason=reasons.CAPTURE_POISONED)
    verified = [make_rollout(sample=0, reward=1.0), make_rollout(sample=1, reward=0.0), poisoned]
    rows = rows_of(assemble(verified, group_size=3))
    np.testing.assert_array_equal(rows[2].input_ids, poisoned.input_ids)
    assert rows[2].advantage == 0.0 and rows[2].num_turns == 2


def test_masked_row_without_linearization_has_empty_lists():
    broken = make_rollout(sample=1, reason=reasons.CHAIN_HASH_MISMATCH, linearized=False)
    row = rows_of(assemble([make_rollout(sample=0), broken], group_size=2))[1]
    assert (row.input_ids.size, row.loss_mask.size, row.logprobs.size) == (0, 0, 0)
    assert row.call_spans == () and row.weight_version_min is None and row.mask_reason == reasons.CHAIN_HASH_MISMATCH


def test_drop_mode_writes_only_valid_rows_but_keeps_planned_group_size():
    verified = [make_rollout(sample=0, reward=1.0), make_rollout(sample=1, reason=reasons.ROLLOUT_FAILED)]
    result = assemble(verified, group_size=3, on_invalid="drop")
    rows = rows_of(result)
    assert [r.rollout_id for r in rows] == [planned_ids(0, 3)[0]]
    assert rows[0].group_size == 3
    assert result.groups[0].rows == 1 and dict(result.groups[0].invalid_reasons)[reasons.MISSING_RECEIPT] == 1


def test_advantages_use_only_valid_rows():
    verified = [
        make_rollout(sample=0, reward=1.0),
        make_rollout(sample=1, reward=0.0),
        make_rollout(sample=2, reward=100.0, reason=reasons.CORRUPT_DIGEST),
    ]
    rows = rows_of(assemble(verified, group_size=3, advantage="dr_grpo"))
    assert [r.advantage for r in rows] == [0.5, -0.5, 0.0]


def test_group_with_one_valid_row_reports_single_valid_and_zero_advantage():
    result = assemble([make_rollout(sample=0, reward=1.0)], group_size=2)
    assert result.groups[0].advantage_outcome == "single_valid" and rows_of(result)[0].advantage == 0.0


def test_group_without_valid_rows_reports_no_valid_and_no_weight_version():
    result = assemble([make_rollout(sample=0, reason=reasons.ROLLOUT_FAILED)], group_size=2)
    assert result.groups[0].advantage_outcome == "no_valid" and result.groups[0].weight_version is None
    assert all(r.sample_mask == 0 for r in rows_of(result))


def test_weight_versions_per_row_and_group_minimum_over_valid_rows():
    verified = [
        make_rollout(sample=0, reward=1.0, versions=[3, 5]),
        make_rollout(sample=1, reward=0.0, versions=[4, 4]),
        make_rollout(sample=2, reward=0.0, versions=[1, 1], reason=reasons.CORRUPT_DIGEST),
    ]
    result = assemble(verified, group_size=3)
    rows = rows_of(result)
    assert [(r.weight_version_min, r.weight_version_max) for r in rows] == [(3, 5), (4, 4), (1, 1)]
    assert result.groups[0].weight_version == 3
    assert [s.weight_version for s in rows[0].weight_version_spans] == [3, 5]


def test_rollout_of_another_group_is_refused_by_id():
    with pytest.raises(ValueError, match=r"r000001-00 is of batch batch-test group g000001"):
        assemble([make_rollout(task=1)])


def test_unplanned_or_repeated_rollout_is_refused_by_id():
    with pytest.raises(ValueError, match="r000000-05 is not planned"):
        assemble([make_rollout(sample=5)])
    with pytest.raises(ValueError, match="r000000-01 is given twice"):
        assemble([make_rollout(sample=1), make_rollout(sample=1)])


def test_unknown_on_invalid_policy_is_refused():
    with pytest.raises(ValueError, match="'keep'"):
        assemble([], on_invalid="keep")


@pytest.mark.parametrize("on_invalid", ["mask", "drop"])
def test_a_group_assembles_the_same_rows_alone_as_among_other_groups_given_in_any_order(on_invalid: str) -> None:
    config = batch_config(num_tasks=4, on_invalid=on_invalid, advantage="rloo")
    by_group = mixed_rollouts(config)
    given = [v for verified in reversed(by_group.values()) for v in reversed(verified)]  # chains out of row order
    together = assemble_rows(
        columns_of(BATCH_ID, given),
        batch_id=BATCH_ID,
        planned={group_id: planned_ids(task, config.group_size) for task, group_id in enumerate(by_group)},
        weights=UNVERIFIED_PLAN,
        on_invalid=on_invalid,
        advantage="rloo",
    )
    alone = mixed_groups(config)
    assert together.table.equals(pa.concat_tables([g.table for g in alone]))
    assert together.groups == tuple(g.groups[0] for g in alone)
    assert together.receipts == len(given) == sum(g.receipts for g in alone)


@settings(max_examples=60, deadline=None)
@given(
    outcomes=st.lists(st.sampled_from(["valid", "invalid", "unlinearized", "missing"]), min_size=1, max_size=8),
    rewards=st.lists(st.floats(-1, 1, allow_nan=False), min_size=8, max_size=8),
    on_invalid=st.sampled_from(["mask", "drop"]),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
)
def test_assembled_groups_keep_the_contract(outcomes, rewards, on_invalid, estimator):
    verified = []
    for sample, outcome in enumerate(outcomes):
        if outcome == "missing":
            continue
        reason = None if outcome == "valid" else reasons.CORRUPT_DIGEST
        verified.append(
            make_rollout(sample=sample, reward=rewards[sample], reason=reason, linearized=outcome != "unlinearized")
        )
    result = assemble(verified, group_size=len(outcomes), on_invalid=on_invalid, advantage=estimator)
    rows = rows_of(result)  # every row's invariants hold
    valid = outcomes.count("valid")
    assert len(rows) == (len(outcomes) if on_invalid == "mask" else valid)
    assert [r.rollout_id for r in rows] == sorted(r.rollout_id for r in rows)
    assert sum(r.sample_mask for r in rows) == valid
    assert all(r.advantage == 0.0 for r in rows if r.sample_mask == 0)
    assert sum(dict(result.groups[0].invalid_reasons).values()) == len(outcomes) - valid
    if estimator != "rloo" and valid:
        assert abs(sum(r.advantage for r in rows)) < 1e-6 * len(outcomes)
