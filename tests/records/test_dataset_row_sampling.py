"""Schema 3 of the dataset row: every row says how its tokens were sampled and, when that truncates, its mask.

The kept sets follow the row's sampled tokens (one set per position where ``loss_mask`` is 1, the token in its
own set: :meth:`KeptSets.check`, the one rule); they are present exactly when the sampling is recorded and
truncates and the row has a sampled token. Rows of schema 1 and 2 read with their sampling not recorded (null)
and no mask.
"""

from __future__ import annotations

import dataclasses
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.finalize import reasons
from tasks.records.dataset_row import (
    KEPT_COLUMNS,
    SAMPLING_COLUMNS,
    V2_SCHEMA,
    DatasetRow,
    InvalidDatasetRowError,
    upgrade_rows,
)
from tasks.records.sampling_mask import KeptSets
from tests.finalize.rollouts import TRUNCATED, assemble, kept_sets_of, make_rollout, rows_of


def truncated_rows() -> list[DatasetRow]:
    """A trainable truncated row, a masked one that kept its tokens, a masked one without tokens, one missing."""
    verified = [
        make_rollout(sample=0, kept=True),
        make_rollout(sample=1, kept=True, reason=reasons.NO_REWARD, reward=None),
        make_rollout(sample=2, reason=reasons.CHAIN_HASH_MISMATCH, linearized=False),
    ]
    return rows_of(assemble(verified, group_size=4, sampling=TRUNCATED))


def test_a_truncated_rows_kept_sets_follow_its_sampled_tokens_and_round_trip_through_parquet():
    rows = truncated_rows()
    trained, masked, untokened, missing = rows
    for row in rows:
        assert (row.temperature, row.top_p, row.top_k, row.logprobs_mode) == (0.9, 0.9, 50, "processed")
        assert row.sampling_recorded and row.truncates
    for row in (trained, masked):
        sampled = row.input_ids[row.loss_mask == 1]
        assert len(row.kept) == sampled.size == int(row.loss_mask.sum())
        expected = kept_sets_of(sampled)
        assert [s.tolist() for s in row.kept.sets()] == [s.tolist() for s in expected.sets()]
    assert not untokened.kept and not missing.kept and untokened.kept_token_ids.size == 0
    sink = io.BytesIO()
    pq.write_table(DatasetRow.to_table(rows), sink)
    table = pq.read_table(pa.BufferReader(sink.getvalue()))
    assert table.schema.equals(DatasetRow.arrow_schema())
    assert DatasetRow.from_table(table) == rows


def test_an_untruncated_row_records_its_sampling_and_holds_no_kept_sets():
    (row, *_) = rows_of(assemble([make_rollout(sample=0)], group_size=1))
    assert (row.temperature, row.top_p, row.top_k, row.logprobs_mode) == (1.0, 1.0, -1, "processed")
    assert row.truncates is False and not row.kept


def test_a_truncating_row_with_sampled_tokens_but_no_kept_sets_is_refused():
    trained = truncated_rows()[0]
    with pytest.raises(InvalidDatasetRowError, match=r"r000000-00: kept sets are present exactly when .* has none"):
        dataclasses.replace(trained, kept_counts=[], kept_token_ids=[])


def test_kept_sets_on_a_row_that_does_not_truncate_or_has_no_sampled_token_are_refused():
    trained, _, untokened, _ = truncated_rows()
    with pytest.raises(InvalidDatasetRowError, match=r"truncates: False.*but it has 5"):
        dataclasses.replace(trained, top_p=1.0, top_k=-1)
    with pytest.raises(InvalidDatasetRowError, match=r"sampled tokens: 0\), but it has 1"):
        dataclasses.replace(untokened, kept_counts=[1], kept_token_ids=[7])
    with pytest.raises(InvalidDatasetRowError, match="kept_token_ids holds ids without kept_counts"):
        dataclasses.replace(untokened, kept_token_ids=[7])


def test_kept_sets_that_do_not_fit_the_sampled_tokens_are_refused_by_the_one_rule():
    trained = truncated_rows()[0]
    sampled = trained.input_ids[trained.loss_mask == 1]
    elsewhere = KeptSets.of([[int(t) + 1] for t in sampled])  # right sizes, but never the sampled token
    with pytest.raises(InvalidDatasetRowError, match=r"kept sets: sampled token 0 \(\d+\) is not in its own kept set"):
        dataclasses.replace(trained, kept_counts=elsewhere.counts, kept_token_ids=elsewhere.token_ids)
    short = kept_sets_of(sampled[:-1])
    with pytest.raises(InvalidDatasetRowError, match="kept sets hold 4 counts for 5 sampled tokens"):
        dataclasses.replace(trained, kept_counts=short.counts, kept_token_ids=short.token_ids)
    with pytest.raises(InvalidDatasetRowError, match="strictly ascending"):
        dataclasses.replace(trained, kept_token_ids=trained.kept_token_ids[::-1].copy())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"temperature": None}, "all null .* or all set"),
        ({"logprobs_mode": None}, "all null .* or all set"),
        ({"top_k": 0}, "sampling: top_k must be -1"),
        ({"top_p": 1.5}, r"sampling: top_p must be in \(0, 1\]"),
        ({"temperature": float("nan")}, "sampling: temperature must be a finite number"),
        ({"logprobs_mode": "raw"}, "sampling: logprobs_mode must be 'processed'"),
    ],
)
def test_sampling_columns_breaking_their_rules_are_refused(changes, message):
    with pytest.raises(InvalidDatasetRowError, match=message):
        dataclasses.replace(truncated_rows()[0], **changes)


def test_a_row_whose_sampling_is_not_recorded_claims_no_mask():
    trained = truncated_rows()[0]
    unrecorded = dict.fromkeys(SAMPLING_COLUMNS)
    row = dataclasses.replace(trained, **unrecorded, kept_counts=[], kept_token_ids=[])
    assert not row.sampling_recorded and row.truncates is None and not row.kept
    with pytest.raises(InvalidDatasetRowError, match=r"recorded: False.*but it has 5"):
        dataclasses.replace(trained, **unrecorded)


def test_a_version_2_table_reads_with_its_sampling_not_recorded_and_no_kept_sets():
    rows = truncated_rows()
    v2 = DatasetRow.to_table(rows).drop_columns([*SAMPLING_COLUMNS, *KEPT_COLUMNS])
    assert v2.schema.equals(V2_SCHEMA)
    table = upgrade_rows(v2)
    assert table.schema.equals(DatasetRow.arrow_schema())
    for name in SAMPLING_COLUMNS:
        assert table.column(name).null_count == len(rows)
    for name in KEPT_COLUMNS:
        assert table.column(name).to_pylist() == [[]] * len(rows)
    upgraded = DatasetRow.from_table(table)  # every row invariant holds
    assert not any(row.sampling_recorded or row.kept for row in upgraded)
    assert table.select(V2_SCHEMA.names).equals(v2)  # nothing else changed
