"""One definition per record: a dataclass whose fields carry their Arrow types.

A record class declares each column once with :func:`column`; its Arrow schema, its Parquet
I/O (:meth:`ArrowRecord.to_table` / :meth:`ArrowRecord.from_table`) and the schema check
readers run (:meth:`ArrowRecord.check_table`) are all derived from that declaration, so the
column list is never typed twice. Invariants live in each record's ``__post_init__``.
List columns are held as read-only numpy arrays so tables build without per-token loops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Self

import numpy as np
import pyarrow as pa


class SchemaMismatchError(ValueError):
    """A table does not have exactly the columns and types its record class declares."""


def column(arrow_type: pa.DataType, *, nullable: bool = False, default: Any = dataclasses.MISSING) -> Any:
    """Declare a record field together with its Arrow type and nullability."""
    return dataclasses.field(default=default, metadata={"arrow": arrow_type, "nullable": nullable})


def _is_list(arrow_type: pa.DataType) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


class ArrowRecord:
    """Base class of frozen dataclass records that map one-to-one onto Arrow rows."""

    _schema_cache: ClassVar[dict[type, pa.Schema]] = {}

    @classmethod
    def arrow_schema(cls) -> pa.Schema:
        schema = ArrowRecord._schema_cache.get(cls)
        if schema is None:
            schema = pa.schema(
                [
                    pa.field(f.name, f.metadata["arrow"], nullable=f.metadata["nullable"])
                    for f in dataclasses.fields(cls)
                ]
            )
            ArrowRecord._schema_cache[cls] = schema
        return schema

    @classmethod
    def column_names(cls) -> list[str]:
        return cls.arrow_schema().names

    @classmethod
    def check_table(cls, table: pa.Table, *, source: str = "table") -> None:
        """Raise :class:`SchemaMismatchError` naming every missing, extra or mistyped column."""
        expected = cls.arrow_schema()
        problems = []
        missing = [n for n in expected.names if n not in table.column_names]
        extra = [n for n in table.column_names if n not in expected.names]
        if missing:
            problems.append(f"missing columns {missing}")
        if extra:
            problems.append(f"unexpected columns {extra}")
        for f in expected:
            if f.name in table.column_names:
                actual = table.schema.field(f.name).type
                if actual != f.type:
                    problems.append(f"column {f.name!r} is {actual}, expected {f.type}")
                elif not f.nullable and table.column(f.name).null_count:
                    problems.append(f"column {f.name!r} holds nulls")
        if problems:
            raise SchemaMismatchError(f"{source} does not match the {cls.__name__} schema: " + "; ".join(problems))

    @classmethod
    def to_table(cls, records: Sequence[Self]) -> pa.Table:
        schema = cls.arrow_schema()
        arrays = []
        for f in schema:
            values = [getattr(r, f.name) for r in records]
            if _is_list(f.type):
                arrays.append(_list_array(values, f.type))
            else:
                arrays.append(pa.array(values, type=f.type))
        return pa.Table.from_arrays(arrays, schema=schema)

    @classmethod
    def from_table(cls, table: pa.Table, *, source: str = "table") -> list[Self]:
        """Records of every row, each validated by the record's own invariants."""
        cls.check_table(table, source=source)
        columns: dict[str, list[Any]] = {}
        for f in cls.arrow_schema():
            chunked = table.column(f.name)
            if _is_list(f.type):
                columns[f.name] = _list_values(chunked)
            else:
                columns[f.name] = chunked.to_pylist()
        names = list(columns)
        return [cls(**dict(zip(names, row, strict=True))) for row in zip(*columns.values(), strict=True)]

    def to_row(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, np.ndarray) or isinstance(theirs, np.ndarray):
                if not np.array_equal(np.asarray(mine), np.asarray(theirs)):
                    return False
            elif mine != theirs:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


def _list_array(values: Iterable[Any], arrow_type: pa.DataType) -> pa.Array:
    arrays = [np.asarray(v) for v in values]
    value_type = arrow_type.value_type.to_pandas_dtype()
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32 if pa.types.is_list(arrow_type) else np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(arrays).astype(value_type, copy=False) if arrays else np.zeros(0, dtype=value_type)
    list_type = pa.ListArray if pa.types.is_list(arrow_type) else pa.LargeListArray
    return list_type.from_arrays(pa.array(offsets), pa.array(flat, type=arrow_type.value_type), type=arrow_type)


def _list_values(chunked: pa.ChunkedArray) -> list[np.ndarray | None]:
    """Each list cell as a read-only numpy view over the column's values (None for a null)."""
    out: list[np.ndarray | None] = []
    for chunk in chunked.chunks:
        flat = chunk.flatten().to_numpy(zero_copy_only=False)
        offsets = chunk.offsets.to_numpy() - chunk.offsets[0].as_py()
        valid = chunk.is_valid().to_numpy(zero_copy_only=False)
        for i in range(len(chunk)):
            out.append(flat[offsets[i] : offsets[i + 1]] if valid[i] else None)
    return out


def frozen_array(values: Any, dtype: np.dtype | type) -> np.ndarray:
    """A read-only numpy copy (or view) of ``values`` with ``dtype``."""
    arr = np.array(values, dtype=dtype, copy=True) if not isinstance(values, np.ndarray) else values.astype(dtype)
    arr.flags.writeable = False
    return arr
