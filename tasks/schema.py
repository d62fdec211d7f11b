"""One definition per record: a dataclass whose fields carry their Arrow types.

A record class declares each column once with :func:`column`; its Arrow schema, its Parquet
I/O (:meth:`ArrowRecord.to_table` / :meth:`ArrowRecord.from_table`) and the schema check
readers run (:meth:`ArrowRecord.check_table`) are all derived from that declaration, so the
column list is never typed twice. Invariants are each record's own (see :mod:`tasks.records.rules`).
List columns are held as read-only numpy arrays so tables build without per-token loops;
a list<struct> column is held as a tuple of frozen dataclasses (its ``item`` class), a list<string>
column as a tuple of str. A column added after files were written names the value an older file's
rows hold (``added``): :meth:`ArrowRecord.upgrade` fills it in before the schema check.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, Self

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.errors import SchemaMismatchError


def read_parquet_bytes(data: bytes, *, use_threads: bool = False) -> pa.Table:
    """The table of one in-memory Parquet file.

    ``ParquetFile`` rather than ``read_table``: no dataset layer (whose import alone costs a
    quarter second per process), and one thread by default, since callers read many small
    files and parallelise across them.
    """
    return pq.ParquetFile(pa.BufferReader(data)).read(use_threads=use_threads)


def column(
    arrow_type: pa.DataType,
    *,
    nullable: bool = False,
    default: Any = dataclasses.MISSING,
    item: type | None = None,
    added: Any = dataclasses.MISSING,
) -> Any:
    """Declare a record field together with its Arrow type and nullability.

    ``item`` is required for (and only for) a list<struct> column: the dataclass each element is
    held as, whose fields are the struct's fields. ``added``: the column is newer than files
    already written; their rows read as holding this value (see :meth:`ArrowRecord.upgrade`).
    """
    if _is_struct_list(arrow_type) != (item is not None):
        raise TypeError(f"column {arrow_type}: `item` must be given exactly for a list<struct> column")
    metadata = {"arrow": arrow_type, "nullable": nullable, "item": item, "added": added}
    return dataclasses.field(default=default, metadata=metadata)


def _is_list(arrow_type: pa.DataType) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _is_struct_list(arrow_type: pa.DataType) -> bool:
    return _is_list(arrow_type) and pa.types.is_struct(arrow_type.value_type)


def _is_string_list(arrow_type: pa.DataType) -> bool:
    return _is_list(arrow_type) and pa.types.is_string(arrow_type.value_type)


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
    def upgrade(cls, table: pa.Table) -> pa.Table:
        """``table`` with every column declared ``added`` that it lacks, holding that value in each row.

        Only the missing added columns are filled; anything else wrong is left for :meth:`check_table`.
        """
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            added = f.metadata["added"]
            if added is dataclasses.MISSING or f.name in table.column_names:
                continue
            field = cls.arrow_schema().field(f.name)
            table = table.append_column(field, pa.array([added] * table.num_rows, type=field.type))
        names = [n for n in cls.column_names() if n in table.column_names]
        extra = [n for n in table.column_names if n not in names]
        return table.select([*names, *extra])

    @classmethod
    def check_table(cls, table: pa.Table, *, source: str = "table") -> None:
        """Raise :class:`SchemaMismatchError` naming every missing, extra or mistyped column."""
        expected = cls.arrow_schema()
        if table.schema.equals(expected) and not any(
            table.column(i).null_count for i, f in enumerate(expected) if not f.nullable
        ):
            return  # exactly the declared columns, in order, nulls only where allowed
        present, wanted = set(table.column_names), set(expected.names)
        problems = []
        missing = [n for n in expected.names if n not in present]
        extra = [n for n in table.column_names if n not in wanted]
        if missing:
            problems.append(f"missing columns {missing}")
        if extra:
            problems.append(f"unexpected columns {extra}")
        for f in expected:
            if f.name in present:
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
        for f, values in zip(schema, _columns(records, schema.names), strict=True):
            if _is_struct_list(f.type):
                arrays.append(_struct_list_array(values, f.type))
            elif _is_string_list(f.type):
                arrays.append(pa.array([None if v is None else list(v) for v in values], type=f.type))
            elif _is_list(f.type):
                arrays.append(_list_array(values, f.type))
            else:
                arrays.append(pa.array(values, type=f.type))
        return pa.Table.from_arrays(arrays, schema=schema)

    @classmethod
    def from_table(cls, table: pa.Table, *, source: str = "table") -> list[Self]:
        """Records of every row, each validated by the record's own invariants."""
        cls.check_table(table, source=source)
        return [cls(**fields) for fields in cls._row_fields(table)]

    @classmethod
    def from_checked_table(cls, table: pa.Table) -> list[Self]:
        """Records of a table whose schema and rows were already proved valid, without re-running ``__post_init__``.

        Only for record classes whose ``__post_init__`` checks and never converts, and only for
        tables their rules accepted (``rules.all_hold``, or :meth:`from_table` itself): a record
        that exists is well-formed, this just does not prove it a second time.
        """
        return [cls.trusted(fields) for fields in cls._row_fields(table)]

    @classmethod
    def trusted(cls, fields: dict[str, Any]) -> Self:
        """A record of ``fields`` without running ``__post_init__``: only for values derived from checked ones."""
        record = object.__new__(cls)
        record.__dict__.update(fields)  # frozen dataclass: fields are set once, here
        return record

    @classmethod
    def _row_fields(cls, table: pa.Table) -> Iterator[dict[str, Any]]:
        """Each row's field values, converted as the record holds them."""
        columns: dict[str, list[Any]] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            chunked = table.column(f.name)
            item = f.metadata["item"]
            if item is not None:
                columns[f.name] = [None if v is None else tuple(item(**d) for d in v) for v in chunked.to_pylist()]
            elif _is_string_list(f.metadata["arrow"]):
                columns[f.name] = [None if v is None else tuple(v) for v in chunked.to_pylist()]
            elif _is_list(f.metadata["arrow"]):
                columns[f.name] = _list_values(chunked)
            else:
                columns[f.name] = chunked.to_pylist()
        names = list(columns)
        return (dict(zip(names, row, strict=True)) for row in zip(*columns.values(), strict=True))

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


def _columns(records: Sequence[Any], names: list[str]) -> list[tuple[Any, ...]]:
    """Each named attribute of every record, column by column (transposed in C, one call per row)."""
    if len(names) == 1 or not records:
        return [tuple(getattr(r, name) for r in records) for name in names]
    return list(zip(*map(operator.attrgetter(*names), records), strict=True))


def _list_array(values: Iterable[Any], arrow_type: pa.DataType) -> pa.Array:
    arrays = [np.asarray(v) for v in values]
    value_type = arrow_type.value_type.to_pandas_dtype()
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32 if pa.types.is_list(arrow_type) else np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(arrays).astype(value_type, copy=False) if arrays else np.zeros(0, dtype=value_type)
    list_type = pa.ListArray if pa.types.is_list(arrow_type) else pa.LargeListArray
    return list_type.from_arrays(pa.array(offsets), pa.array(flat, type=arrow_type.value_type), type=arrow_type)


def _struct_list_array(cells: Sequence[Sequence[Any] | None], list_type: pa.ListType) -> pa.Array:
    """A list<struct> column from cells of dataclasses, built one child array per struct field."""
    items = [item for cell in cells if cell is not None for item in cell]
    fields = list(list_type.value_type)
    children = [pa.array([getattr(item, f.name) for item in items], type=f.type) for f in fields]
    offsets = np.zeros(len(cells) + 1, dtype=np.int32)
    np.cumsum([0 if cell is None else len(cell) for cell in cells], out=offsets[1:])
    nulls = pa.array([cell is None for cell in cells], type=pa.bool_())
    return pa.ListArray.from_arrays(
        pa.array(offsets), pa.StructArray.from_arrays(children, fields=fields), type=list_type, mask=nulls
    )


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
