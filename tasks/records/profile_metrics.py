"""A suite run's profile in numbers, ``reports/{suite}/run-NNN/profile.json``: per table and column.

Written next to the run's ``summary.json``, before it (a run is complete once its summary
exists, so a complete run has both). Per table of the suite's profile: its rows; per column that
holds numbers, booleans or ids: how many values are set and null, how many distinct, and for
numbers and booleans min, max and sum (None when no value is set; a boolean counts as 0 or 1).
Lineage events carry it as OpenLineage data quality metrics (docs/lineage.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from tasks.checks import check_finite, check_int, check_text
from tasks.errors import MalformedSummaryError
from tasks.strict_json import dump_document, load_document


@dataclass(frozen=True)
class ColumnStats:
    """One column: values set (``count``), null, distinct; min, max and sum of numbers (None otherwise)."""

    name: str
    count: int
    nulls: int
    distinct: int
    min: float | None
    max: float | None
    sum: float | None

    def __post_init__(self) -> None:
        check_text(self.name, field="column name")
        for name in ("count", "nulls", "distinct"):
            check_int(getattr(self, name), field=f"{self.name}.{name}")
        for name in ("min", "max", "sum"):
            if getattr(self, name) is not None:
                check_finite(getattr(self, name), field=f"{self.name}.{name}")


@dataclass(frozen=True)
class TableStats:
    """One profile table: its rows and its columns' stats, in the table's column order."""

    name: str
    rows: int
    columns: tuple[ColumnStats, ...]

    def __post_init__(self) -> None:
        check_text(self.name, field="table name")
        check_int(self.rows, field=f"{self.name}.rows")
        for column in self.columns:
            if column.count + column.nulls != self.rows:
                raise ValueError(f"{self.name}.{column.name}: {column.count} set + {column.nulls} null != {self.rows}")


@dataclass(frozen=True)
class ProfileMetrics:
    """A suite run's profile tables in numbers, in the suite's table order."""

    suite: str
    tables: tuple[TableStats, ...]

    def to_json(self) -> str:
        return dump_document(self)

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str) -> Self:
        return load_document(cls, text, source=source, error=MalformedSummaryError)
