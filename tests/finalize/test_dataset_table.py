"""Dataset tables built column-wise are exactly the tables of the generic record encoding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from tasks.finalize import reasons
from tasks.finalize.dataset import DatasetRow, assemble_rows
from tasks.finalize.verified import VerifiedRollout, VerifiedRollouts
from tasks.schema import ArrowRecord

from .rollouts import BATCH_ID, batch_config, make_rollout, mixed_groups, mixed_rollouts, planned_ids
from .test_dataset import assemble


def generic_table(rows: list[DatasetRow]):
    return ArrowRecord.to_table.__func__(DatasetRow, rows)  # the base class's per-item encoding


def test_column_wise_table_equals_the_generic_encoding_for_valid_masked_and_missing_rows() -> None:
    rows = list(
        assemble(
            [make_rollout(sample=0, versions=[1, 2]), make_rollout(sample=2, reason=reasons.NO_REWARD)], group_size=4
        ).rows
    )
    table = DatasetRow.to_table(rows)
    assert table.equals(generic_table(rows))
    assert DatasetRow.from_table(table) == rows


def test_an_empty_row_set_is_the_empty_table_of_the_schema() -> None:
    assert DatasetRow.to_table([]).equals(generic_table([]))


@pytest.mark.parametrize("on_invalid", ["mask", "drop"])
def test_a_shard_of_groups_assembles_exactly_the_rows_of_its_groups_one_by_one(on_invalid: str) -> None:
    config = batch_config(num_tasks=4, on_invalid=on_invalid, advantage="rloo")
    by_group = mixed_rollouts(config)
    given = [v for verified in reversed(by_group.values()) for v in reversed(verified)]  # chains out of row order
    assembled = assemble_rows(
        VerifiedRollouts.of(BATCH_ID, given),
        batch_id=BATCH_ID,
        planned={group_id: planned_ids(task, config.group_size) for task, group_id in enumerate(by_group)},
        on_invalid=on_invalid,
        advantage="rloo",
    )
    one_by_one = mixed_groups(config)
    assert assembled.table.equals(pa.concat_tables([g.table for g in one_by_one]))
    assert assembled.groups == tuple(g.stats for g in one_by_one)
    assert assembled.receipts == len(given) == sum(g.receipts for g in one_by_one)
    assert assembled.rows == tuple(row for g in one_by_one for row in g.rows)  # every row's invariants hold


def test_verified_rollouts_convert_to_columns_and_back() -> None:
    rollouts = [
        make_rollout(sample=0, versions=[1, 2], epoch_span_count=1, truncated=True),
        make_rollout(sample=1, reason=reasons.CHAIN_HASH_MISMATCH, linearized=False),
        make_rollout(sample=2, reason=reasons.CAPTURE_POISONED, calls=((1, 1), (2, 2), (3, 3))),
    ]
    back = list(VerifiedRollouts.of(BATCH_ID, rollouts))
    assert [fields(v) for v in back] == [fields(v) for v in rollouts]


def fields(rollout: VerifiedRollout) -> dict[str, object]:
    return {f.name: np.asarray(getattr(rollout, f.name)).tolist() for f in dataclasses.fields(rollout)}


def test_rollouts_of_another_batch_are_refused() -> None:
    with pytest.raises(ValueError, match="r000000-00 is of batch batch-test, not b-other"):
        VerifiedRollouts.of("b-other", [make_rollout()])
