"""Dataset rows (ARCHITECTURE 4.6) and group assembly: masking, dropping, advantages, invariants."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.finalize import reasons
from tasks.finalize.dataset import DatasetRow, InvalidDatasetRowError, assemble_group
from tasks.finalize.verified import WeightSpan

from .rollouts import BATCH_ID, make_rollout, planned_ids


def assemble(verified, *, task=0, group_size=4, **options):
    return assemble_group(
        verified,
        batch_id=BATCH_ID,
        group_id=f"g{task:06d}",
        planned_rollout_ids=planned_ids(task, group_size),
        **options,
    )


def a_row(**changes) -> DatasetRow:
    row = assemble([make_rollout(sample=0, reward=1.0), make_rollout(sample=1, reward=0.0)], group_size=2).rows[0]
    return dataclasses.replace(row, **changes)


# --- assembly --------------------------------------------------------------------------------


def test_mask_mode_yields_group_size_rows_with_invalid_and_missing_masked():
    verified = [
        make_rollout(sample=0, reward=1.0),
        make_rollout(sample=1, reward=0.0),
        make_rollout(sample=3, reward=1.0, reason=reasons.CAPTURE_POISONED),
    ]
    result = assemble(verified)
    assert [r.rollout_id for r in result.rows] == planned_ids(0, 4)
    assert [r.sample_mask for r in result.rows] == [1, 1, 0, 0]
    assert [r.mask_reason for r in result.rows] == [None, None, reasons.MISSING_RECEIPT, reasons.CAPTURE_POISONED]
    assert [r.group_size for r in result.rows] == [4] * 4
    assert result.rows[2].input_ids.size == 0 and result.rows[2].reward is None
    assert result.stats.missing == 1 and result.stats.valid == 2
    assert dict(result.stats.invalid_reasons) == {reasons.MISSING_RECEIPT: 1, reasons.CAPTURE_POISONED: 1}


def test_masked_row_keeps_verified_tokens_when_linearized_and_has_zero_advantage():
    poisoned = make_rollout(sample=2, reward=5.0, reason=reasons.CAPTURE_POISONED)
    rows = assemble(
        [make_rollout(sample=0, reward=1.0), make_rollout(sample=1, reward=0.0), poisoned], group_size=3
    ).rows
    np.testing.assert_array_equal(rows[2].input_ids, poisoned.input_ids)
    assert rows[2].advantage == 0.0 and rows[2].num_turns == 2


def test_masked_row_without_linearization_has_empty_lists():
    broken = make_rollout(sample=1, reason=reasons.CHAIN_HASH_MISMATCH, linearized=False)
    row = assemble([make_rollout(sample=0), broken], group_size=2).rows[1]
    assert (row.input_ids.size, row.loss_mask.size, row.logprobs.size) == (0, 0, 0)
    assert row.call_spans == () and row.weight_version_min is None and row.mask_reason == reasons.CHAIN_HASH_MISMATCH


def test_drop_mode_writes_only_valid_rows_but_keeps_planned_group_size():
    verified = [make_rollout(sample=0, reward=1.0), make_rollout(sample=1, reason=reasons.ROLLOUT_FAILED)]
    result = assemble(verified, group_size=3, on_invalid="drop")
    assert [r.rollout_id for r in result.rows] == [planned_ids(0, 3)[0]]
    assert result.rows[0].group_size == 3
    assert result.stats.rows == 1 and dict(result.stats.invalid_reasons)[reasons.MISSING_RECEIPT] == 1


def test_advantages_use_only_valid_rows():
    verified = [
        make_rollout(sample=0, reward=1.0),
        make_rollout(sample=1, reward=0.0),
        make_rollout(sample=2, reward=100.0, reason=reasons.CORRUPT_DIGEST),
    ]
    rows = assemble(verified, group_size=3, advantage="dr_grpo").rows
    assert [r.advantage for r in rows] == [0.5, -0.5, 0.0]


def test_group_with_one_valid_row_reports_single_valid_and_zero_advantage():
    result = assemble([make_rollout(sample=0, reward=1.0)], group_size=2)
    assert result.stats.advantage_outcome == "single_valid" and result.rows[0].advantage == 0.0


def test_group_without_valid_rows_reports_no_valid_and_no_weight_version():
    result = assemble([make_rollout(sample=0, reason=reasons.ROLLOUT_FAILED)], group_size=2)
    assert result.stats.advantage_outcome == "no_valid" and result.stats.weight_version is None
    assert all(r.sample_mask == 0 for r in result.rows)


def test_weight_versions_per_row_and_group_minimum_over_valid_rows():
    verified = [
        make_rollout(sample=0, reward=1.0, versions=[3, 5]),
        make_rollout(sample=1, reward=0.0, versions=[4, 4]),
        make_rollout(sample=2, reward=0.0, versions=[1, 1], reason=reasons.CORRUPT_DIGEST),
    ]
    result = assemble(verified, group_size=3)
    assert [(r.weight_version_min, r.weight_version_max) for r in result.rows] == [(3, 5), (4, 4), (1, 1)]
    assert result.stats.weight_version == 3
    assert [s.weight_version for s in result.rows[0].weight_version_spans] == [3, 5]


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
    valid = outcomes.count("valid")
    assert len(result.rows) == (len(outcomes) if on_invalid == "mask" else valid)
    assert [r.rollout_id for r in result.rows] == sorted(r.rollout_id for r in result.rows)
    assert sum(r.sample_mask for r in result.rows) == valid
    assert all(r.advantage == 0.0 for r in result.rows if r.sample_mask == 0)
    assert sum(dict(result.stats.invalid_reasons).values()) == len(outcomes) - valid
    if estimator != "rloo" and valid:
        assert abs(sum(r.advantage for r in result.rows)) < 1e-6 * len(outcomes)


# --- row invariants --------------------------------------------------------------------------


def test_rows_round_trip_through_parquet_with_struct_spans():
    rows = assemble(
        [make_rollout(sample=0, versions=[1, 2]), make_rollout(sample=2, reason=reasons.NO_REWARD)], group_size=3
    ).rows
    sink = io.BytesIO()
    pq.write_table(DatasetRow.to_table(rows), sink)
    table = pq.read_table(pa.BufferReader(sink.getvalue()))
    assert DatasetRow.from_table(table) == list(rows)
    assert table.schema.field("call_spans").type.value_type.names == ["call_id", "carry_len", "gen_len"]


def test_row_with_unequal_list_lengths_is_refused():
    row = a_row()
    with pytest.raises(InvalidDatasetRowError, match=r"r000000-00: input_ids .* differ in length"):
        dataclasses.replace(row, logprobs=row.logprobs[:-1])


def test_row_with_logprob_on_a_carried_token_is_refused():
    logprobs = a_row().logprobs.copy()
    logprobs[0] = -1.0
    with pytest.raises(InvalidDatasetRowError, match="logprobs is not 0 where loss_mask is 0"):
        a_row(logprobs=logprobs)


def test_row_with_nan_logprob_is_refused():
    row = a_row()
    logprobs = row.logprobs.copy()
    logprobs[row.loss_mask == 1] = np.nan
    with pytest.raises(InvalidDatasetRowError, match="non-finite"):
        a_row(logprobs=logprobs)


def test_row_with_mask_value_two_is_refused():
    mask = a_row().loss_mask.copy()
    mask[-1] = 2
    with pytest.raises(InvalidDatasetRowError, match="other than 0 or 1"):
        a_row(loss_mask=mask)


def test_row_whose_mask_contradicts_its_call_spans_is_refused():
    row = a_row()
    mask, logprobs = row.loss_mask.copy(), row.logprobs.copy()
    mask[-1], logprobs[-1] = 0, 0.0
    with pytest.raises(InvalidDatasetRowError, match="loss_mask does not follow call_spans"):
        a_row(loss_mask=mask, logprobs=logprobs)


def test_masked_row_with_nonzero_advantage_is_refused():
    with pytest.raises(InvalidDatasetRowError, match=r"masked row has advantage 0\.5"):
        a_row(sample_mask=0, mask_reason=reasons.CORRUPT_DIGEST, advantage=0.5)


def test_masked_row_needs_a_reason_and_trainable_row_none():
    with pytest.raises(InvalidDatasetRowError, match="needs a mask_reason"):
        a_row(sample_mask=0, advantage=0.0)
    with pytest.raises(InvalidDatasetRowError, match=r"trainable row .* has mask_reason"):
        a_row(mask_reason=reasons.CORRUPT_DIGEST)


def test_trainable_row_without_reward_is_refused():
    with pytest.raises(InvalidDatasetRowError, match="needs a reward"):
        a_row(reward=None)


def test_weight_version_summary_must_match_the_spans():
    with pytest.raises(InvalidDatasetRowError, match="weight_version_min/max"):
        a_row(weight_version_max=9)


def test_weight_span_outside_its_call_is_refused():
    row = a_row()
    first = row.weight_version_spans[0]
    spans = (WeightSpan(first.call_id, 0, first.end + 1, 0), *row.weight_version_spans[1:])
    with pytest.raises(InvalidDatasetRowError, match="outside"):
        a_row(weight_version_spans=spans)


def test_prompt_len_must_be_the_root_carry():
    with pytest.raises(InvalidDatasetRowError, match="prompt_len 3 differs"):
        a_row(prompt_len=3)


def test_token_ids_wider_than_int32_are_refused():
    with pytest.raises(InvalidDatasetRowError, match="1-d int32 array"):
        a_row(input_ids=a_row().input_ids.astype(np.int64))
