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

LedgerRecord = CallRecord | FailureRow | Receipt
RECORD_OF_KIND: dict[str, type[LedgerRecord]] = {"calls": CallRecord, "failures": FailureRow, "receipts": Receipt}


@dataclass(frozen=True)
class RolloutBundle:
    """A receipted rollout with its manifest (call records in ledger order) and failure rows."""

    receipt: Receipt
    manifest: tuple[CallRecord, ...]
    failures: tuple[FailureRow, ...]

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
    """Each receipt with its manifest and the failure rows of its rollout in its own attempt.

    The manifest is the calls the receipt replayed (``replayed_calls``: call records of its rollout
    in earlier attempts, in that order), then its rollout's calls in its own attempt in ledger
    order. ``call_attempts`` / ``failure_attempts`` give the attempt whose file holds each row.
    Other rows (a dead attempt's leftovers) are left out. A replayed call that no earlier attempt
    recorded raises :class:`CorruptLedgerFileError`.
    """
    calls, call_attempts = list(calls), list(call_attempts)
    calls_of = _by_attempt_and_rollout(calls, call_attempts)
    failures_of = _by_attempt_and_rollout(failures, failure_attempts)
    receipts = list(receipts)
    recorded: dict[tuple[str, str], tuple[int, CallRecord]] = {}
    if any(receipt.replayed_calls for receipt in receipts):
        recorded = {(c.rollout_id, c.call_id): (a, c) for c, a in zip(calls, call_attempts, strict=True)}
    return [
        RolloutBundle(
            receipt=receipt,
            manifest=(
                *_replayed(receipt, recorded),
                *calls_of.get((receipt.attempt, receipt.rollout_id), ()),
            ),
            failures=tuple(failures_of.get((receipt.attempt, receipt.rollout_id), ())),
        )
        for receipt in receipts
    ]


def _replayed(receipt: Receipt, recorded: dict[tuple[str, str], tuple[int, CallRecord]]) -> list[CallRecord]:
    """The call records ``receipt`` replayed, each of its rollout in an earlier attempt."""
    found = []
    for call_id in receipt.replayed_calls:
        attempt, call = recorded.get((receipt.rollout_id, call_id), (receipt.attempt, None))
        if call is None or attempt >= receipt.attempt:
            raise CorruptLedgerFileError(
                f"the receipt of {receipt.rollout_id} (attempt {receipt.attempt}) replays call {call_id}, "
                "which no earlier attempt recorded for that rollout"
            )
        found.append(call)
    return found


def _by_attempt_and_rollout(records: Iterable[Any], attempts: Iterable[int]) -> dict[tuple[int, str], list[Any]]:
    grouped: dict[tuple[int, str], list[Any]] = {}
    for record, attempt in zip(records, attempts, strict=True):
        grouped.setdefault((attempt, record.rollout_id), []).append(record)
    return grouped
