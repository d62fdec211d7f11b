"""The ledger's files (docs/architecture.md §4.3-4.5): what each kind holds, how it is encoded, how it is proved.

A ledger file ``{kind}-NNNNNN.parquet`` holds records of one kind (``calls``, ``failures``,
``receipts``) with that record's schema. Decoding a file proves every row satisfies its
record's rules, so no malformed row reaches a reader; a file that fails raises
:class:`CorruptLedgerFileError` naming its path and the problem. The checks here that span
files (a receipt's attempt is its file's, one receipt per rollout) and the grouping of rows
into :class:`RolloutBundle` serve both the committed reader and recovery.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks import layout
from tasks.errors import CorruptLedgerFileError, DuplicateReceiptError
from tasks.records.ledger import CallRecord, FailureRow, Receipt
from tasks.schema import read_parquet_bytes
from tasks.storage.rollout_manifest import own_rows, receipts_table, rollout_manifests

LedgerRecord = CallRecord | FailureRow | Receipt
RECORD_OF_KIND: dict[str, type[LedgerRecord]] = {"calls": CallRecord, "failures": FailureRow, "receipts": Receipt}


@dataclass(frozen=True)
class RolloutBundle:
    """A receipted rollout with its manifest and failure rows (:mod:`tasks.storage.rollout_manifest`); ``complete``:
    every call its receipt replayed was found."""

    receipt: Receipt
    manifest: tuple[CallRecord, ...]
    failures: tuple[FailureRow, ...]
    complete: bool = True

    @property
    def rollout_id(self) -> str:
        return self.receipt.rollout_id


def encode_ledger_file(record_cls: type[LedgerRecord], records: Sequence[LedgerRecord]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(record_cls.to_table(records), sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def decode_ledger_file(kind: str, data: bytes, *, path: str) -> list[Any]:
    """Validated records of a ledger file; :class:`CorruptLedgerFileError` naming ``path`` otherwise."""
    return RECORD_OF_KIND[kind].from_checked_table(decode_ledger_table(kind, data, path=path))


def decode_ledger_table(kind: str, data: bytes, *, path: str) -> pa.Table:
    """A ledger file as a table of its record's schema, every row proved valid (:func:`prove_rows`)."""
    table = parse_ledger_table(kind, data, path=path)
    prove_rows(kind, [(path, table)])
    return table


def parse_ledger_table(kind: str, data: bytes, *, path: str) -> pa.Table:
    """A ledger file as a table of its record's schema (columns in schema order); rows not yet proved valid.

    A file written before a column was added reads with the value its rows mean (``ArrowRecord.upgrade``).
    """
    record_cls = RECORD_OF_KIND[kind]
    try:
        table = record_cls.upgrade(read_parquet_bytes(data))
        record_cls.check_table(table, source=path)
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise CorruptLedgerFileError(f"ledger file {path} cannot be read as {kind}: {exc}") from None
    return table.select(record_cls.column_names())


def prove_rows(kind: str, files: Sequence[tuple[str, pa.Table]]) -> None:
    """Prove that every row of the ``kind`` tables (path, table) satisfies its record's rules.

    All tables are checked column-wise at once (``rules.all_hold``); when that fails they are
    decoded record by record, so the first malformed file raises :class:`CorruptLedgerFileError`
    naming its path and the record's own complaint.
    """
    record_cls = RECORD_OF_KIND[kind]
    tables = [table for _, table in files]
    if not tables or record_cls.rules.all_hold(pa.concat_tables(tables)):
        return
    for path, table in files:
        try:
            record_cls.from_table(table, source=path)
        except (pa.ArrowException, ValueError, TypeError) as exc:
            raise CorruptLedgerFileError(f"ledger file {path} cannot be read as {kind}: {exc}") from None


def first_differing(table: pa.Table, name: str, expected: object) -> dict[str, Any] | None:
    """The first row whose ``name`` differs from ``expected``, or None when every row has it."""
    same = pc.fill_null(pc.equal(table.column(name), expected), False)
    if pc.all(same, min_count=0).as_py():
        return None
    index = int(np.flatnonzero(~same.to_numpy(zero_copy_only=False))[0])
    return table.slice(index, 1).to_pylist()[0]


def check_receipt_attempts(files: Iterable[tuple[str, pa.Table]]) -> None:
    """Every receipt says the attempt of the file (path, receipts table) that holds it."""
    for path, receipts in files:
        attempt = layout.attempt_of(path)
        row = first_differing(receipts, "attempt", attempt)
        if row is not None:
            raise CorruptLedgerFileError(
                f"{path}: receipt of {row['rollout_id']} says attempt {row['attempt']}, "
                f"the file belongs to attempt {attempt}"
            )


def check_unique_receipts(rollout_ids: Iterable[str], *, where: str) -> None:
    """At most one receipt per rollout; :class:`DuplicateReceiptError` naming ``where`` and the rollout."""
    seen: set[str] = set()
    for rollout_id in rollout_ids:
        if rollout_id in seen:
            raise DuplicateReceiptError(f"{where}: rollout {rollout_id} has more than one receipt")
        seen.add(rollout_id)


def bundle_rollouts(
    receipts: Iterable[Receipt],
    calls: Iterable[CallRecord],
    failures: Iterable[FailureRow],
    *,
    call_attempts: Iterable[int],
    failure_attempts: Iterable[int],
) -> list[RolloutBundle]:
    """Each receipt with its manifest and failure rows, as the one manifest rule says
    (:mod:`tasks.storage.rollout_manifest`). ``call_attempts`` / ``failure_attempts`` give the attempt whose file
    holds each row. A receipt whose replayed calls are not all found keeps the calls that were (``complete`` is
    False): the rule's policy, fail closed, is finalize's to apply."""
    receipts, calls, failures = list(receipts), list(calls), list(failures)
    receipt_table = receipts_table(receipts)
    call_keys = pa.table(
        {name: pa.array([getattr(c, name) for c in calls], pa.string()) for name in ("rollout_id", "call_id")}
    )
    manifests = rollout_manifests(call_keys, np.asarray(list(call_attempts), np.int64), receipt_table)
    failure_keys = pa.table({"rollout_id": pa.array([f.rollout_id for f in failures], pa.string())})
    failure_rows, failure_starts = own_rows(failure_keys, np.asarray(list(failure_attempts), np.int64), receipt_table)
    return [
        RolloutBundle(
            receipt=receipt,
            manifest=tuple(calls[row] for row in manifests.of(i)),
            failures=tuple(failures[row] for row in failure_rows[failure_starts[i] : failure_starts[i + 1]]),
            complete=manifests.complete(i),
        )
        for i, receipt in enumerate(receipts)
    ]
