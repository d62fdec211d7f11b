"""The numbers of a suite's profile (:class:`~tasks.records.profile_metrics.ProfileMetrics`), computed with Arrow."""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc

from tasks.records.profile_metrics import ColumnStats, ProfileMetrics, TableStats


def profile_metrics(suite: str, tables: Mapping[str, pa.Table]) -> ProfileMetrics:
    """Per table (in the order given) its rows, and per column of numbers, booleans or strings its stats."""
    return ProfileMetrics(
        suite=suite,
        tables=tuple(
            TableStats(
                name=name,
                rows=table.num_rows,
                columns=tuple(
                    _column_stats(field.name, table.column(field.name))
                    for field in table.schema
                    if _is_scalar(field.type)
                ),
            )
            for name, table in tables.items()
        ),
    )


def _is_scalar(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind) or _is_text(kind)


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _column_stats(name: str, column: pa.ChunkedArray) -> ColumnStats:
    nulls = column.null_count
    numbers = None if _is_text(column.type) else column.cast(pa.int64()) if pa.types.is_boolean(column.type) else column
    if numbers is not None and pa.types.is_floating(numbers.type):
        numbers = pc.filter(numbers, pc.is_finite(numbers))  # a NaN or infinity is counted, never summed
    bounds = pc.min_max(numbers) if numbers is not None else None
    total = pc.sum(numbers).as_py() if numbers is not None else None
    return ColumnStats(
        name=name,
        count=len(column) - nulls,
        nulls=nulls,
        distinct=pc.count_distinct(column, mode="only_valid").as_py(),
        min=None if bounds is None else _number(bounds["min"].as_py()),
        max=None if bounds is None else _number(bounds["max"].as_py()),
        sum=None if total is None else _number(total),
    )


def _number(value: int | float | None) -> float | None:
    return None if value is None else float(value)
