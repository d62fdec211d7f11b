"""The dataset row (docs/architecture.md §4.6): its schema, its invariants, and column-wise tables that honour both."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.finalize import reasons
from tasks.finalize.assemble import assemble_rows
from tasks.records.dataset_row import DatasetRow, InvalidDatasetRowError, VersionWeights, WeightSpan
from tests.finalize.rollouts import BATCH_ID, UNVERIFIED_PLAN, assemble, make_rollout, rows_of
from tests.finalize.verdicts import columns_of


def a_row(**changes) -> DatasetRow:
    row = rows_of(assemble([make_rollout(sample=0, reward=1.0), make_rollout(sample=1, reward=0.0)], group_size=2))[0]
    return dataclasses.replace(row, **changes)


def test_rows_built_column_wise_equal_the_record_by_record_encoding_of_the_same_rows() -> None:
    verified = [
        make_rollout(sample=0, versions=[1, 2], truncated=True),
        make_rollout(sample=1, reason=reasons.CHAIN_HASH_MISMATCH, linearized=False),
        make_rollout(sample=2, reason=reasons.NO_REWARD),
    ]
    table = assemble(verified, group_size=4).table  # sample 3 has no receipt
    assert table.equals(DatasetRow.to_table(DatasetRow.from_table(table)))


def test_no_group_assembles_the_empty_table_of_the_schema() -> None:
    empty = assemble_rows(columns_of(BATCH_ID, []), batch_id=BATCH_ID, planned={}, weights=UNVERIFIED_PLAN)
    assert empty.table.equals(DatasetRow.to_table([]))


def test_rows_round_trip_through_parquet_with_struct_spans():
    rows = rows_of(
        assemble(
            [make_rollout(sample=0, versions=[1, 2]), make_rollout(sample=2, reason=reasons.NO_REWARD)], group_size=3
        )
    )
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


SHA = "ab" * 32


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ((), "empty exactly when the row has no tokens"),
        ((VersionWeights(0, SHA), VersionWeights(0, None)), r"each version once, ascending, got \[0, 0\]"),
        ((VersionWeights(2, None), VersionWeights(0, SHA)), r"each version once, ascending, got \[2, 0\]"),
        ((VersionWeights(0, SHA.upper()),), "not a sha256"),
        ((VersionWeights(0, "declared, not verified"),), "not a sha256"),
        ((VersionWeights(1, SHA),), r"does not name weight version\(s\) \[0\] of weight_version_spans"),
        (((0, SHA),), "must hold VersionWeights items"),
    ],
)
def test_weights_by_version_breaking_its_rules_is_refused(weights, message):
    with pytest.raises(InvalidDatasetRowError, match=message):
        a_row(weights_by_version=weights)


def test_weights_by_version_names_versions_beyond_the_spans_and_nothing_without_tokens():
    row = a_row(weights_by_version=(VersionWeights(0, SHA), VersionWeights(1, None)))  # a call spanning a refit
    assert row.weights_by_version == (VersionWeights(0, SHA), VersionWeights(1, None))
    (placeholder,) = rows_of(assemble([make_rollout(reason=reasons.NO_REWARD, linearized=False)], group_size=1))
    assert placeholder.input_ids.size == 0 and placeholder.weights_by_version == ()
    with pytest.raises(InvalidDatasetRowError, match="empty exactly when the row has no tokens"):
        dataclasses.replace(placeholder, weights_by_version=(VersionWeights(0, None),))
