"""DatasetRow.to_table (column-wise) builds exactly the table of the generic record encoding."""

from __future__ import annotations

from tasks.finalize import reasons
from tasks.finalize.dataset import DatasetRow
from tasks.schema import ArrowRecord

from .rollouts import make_rollout
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
