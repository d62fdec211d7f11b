"""The trusted reader of a committed shard's ledger (docs/architecture.md §4.3-4.5, §2).

Readers trust only what a shard's ``_COMMITTED.json`` names: each named ledger file must have
the size and sha256 the marker recorded (``segment_checksum_mismatch`` otherwise) and the
number of rows it says, every row must satisfy its record's rules, rows of calls and failures
belong to the marker's batch, receipts to the attempt of their file, and no rollout has two
receipts. Staging segments are verified later, by whoever reads them (``StagedReader``).
:attr:`LedgerReader.calls_used` counts the calls the receipted rollouts use from the named files,
the figure a version-2 marker records (``counts.calls_used``) and a version-1 marker lacks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa

from tasks import layout
from tasks.errors import CorruptLedgerFileError, MalformedMarkerError, UncommittedShardError
from tasks.records.ledger import CallRecord, FailureRow, Receipt
from tasks.storage.ledger_files import (
    RECORD_OF_KIND,
    RolloutBundle,
    bundle_rollouts,
    check_receipt_attempts,
    check_unique_receipts,
    first_differing,
    parse_ledger_table,
    prove_rows,
)
from tasks.storage.marker import MarkedFile, calls_in_manifests, read_marked_bytes, read_marker
from tasks.storage.objects import ObjectStore


@dataclass(frozen=True)
class LedgerTables:
    """A committed shard's ledger as checked tables, rows in ledger order (the marker's file order).

    Each table has its record's schema and every row satisfies the record's rules;
    ``call_attempts`` / ``failure_attempts`` (int64) give the attempt whose file holds each row.
    """

    calls: pa.Table
    call_attempts: np.ndarray
    failures: pa.Table
    failure_attempts: np.ndarray
    receipts: pa.Table


class LedgerReader:
    """The committed ledger of one shard, read only through its marker.

    Raises :class:`UncommittedShardError` without a marker, and
    :class:`SegmentChecksumMismatchError` naming a ledger file whose size or sha256 differs
    from the marker. Staging segments are not read here: ``segment_sha256`` maps each named
    segment to its committed sha256 for ``StagedReader``. The rows are held as checked tables
    (:attr:`tables`); ``receipts``, ``calls``, ``failures`` and :meth:`rollouts` build records
    from them on first use.
    """

    def __init__(self, store: ObjectStore, shard: int) -> None:
        marker = read_marker(store, shard)
        if marker is None:
            raise UncommittedShardError(f"shard {shard} has no commit marker at {layout.shard_marker(shard)}")
        self.marker = marker
        self.segment_sha256: dict[str, str] = {f.path: f.sha256 for f in marker.files_of("staging")}
        loaded = {kind: [(f, _read_verified(store, f)) for f in marker.files_of(kind)] for kind in layout.LEDGER_KINDS}
        for kind, files in loaded.items():
            prove_rows(kind, [(marked.path, table) for marked, table in files])
        for kind in ("calls", "failures"):
            for marked, table in loaded[kind]:
                row = first_differing(table, "batch_id", marker.batch_id)
                if row is not None:
                    raise CorruptLedgerFileError(
                        f"{marked.path}: call {row['call_id']} belongs to batch {row['batch_id']}, "
                        f"the marker commits batch {marker.batch_id}"
                    )
        check_receipt_attempts((marked.path, table) for marked, table in loaded["receipts"])
        self.tables = LedgerTables(
            calls=_concat("calls", loaded["calls"]),
            call_attempts=_attempts(loaded["calls"]),
            failures=_concat("failures", loaded["failures"]),
            failure_attempts=_attempts(loaded["failures"]),
            receipts=_concat("receipts", loaded["receipts"]),
        )
        check_unique_receipts(self.tables.receipts.column("rollout_id").to_pylist(), where=f"shard {shard}")

    @cached_property
    def calls_used(self) -> int:
        """The calls the receipted rollouts' manifests hold, each once, counted from the named files
        (:func:`~tasks.storage.marker.calls_in_manifests`): a version-1 marker's unknown ``calls_used``.

        A marker that records another figure is refused (:class:`MalformedMarkerError`): its writer
        disagreed with the rows it committed.
        """
        tables = self.tables
        used = calls_in_manifests(tables.calls, tables.call_attempts, tables.receipts)
        recorded = self.marker.counts.calls_used
        if recorded is not None and recorded != used:
            raise MalformedMarkerError(
                f"{layout.shard_marker(self.marker.shard)}: counts.calls_used is {recorded}, "
                f"the manifests of its receipts hold {used} of the named call records"
            )
        return used

    @cached_property
    def receipts(self) -> tuple[Receipt, ...]:
        return tuple(Receipt.from_checked_table(self.tables.receipts))

    @cached_property
    def calls(self) -> tuple[CallRecord, ...]:
        return tuple(CallRecord.from_checked_table(self.tables.calls))

    @cached_property
    def failures(self) -> tuple[FailureRow, ...]:
        return tuple(FailureRow.from_checked_table(self.tables.failures))

    def rollouts(self) -> Iterator[RolloutBundle]:
        """Every receipted rollout in receipt order; its calls and failures come only from its attempt.

        Rows of rollouts without a receipt in that attempt (a dead attempt's leftovers) are ignored.
        """
        yield from bundle_rollouts(
            self.receipts,
            self.calls,
            self.failures,
            call_attempts=self.tables.call_attempts.tolist(),
            failure_attempts=self.tables.failure_attempts.tolist(),
        )


def _read_verified(store: ObjectStore, marked: MarkedFile) -> pa.Table:
    """The file's table (rows not yet proved valid), after its size, sha256 and row count checks."""
    table = parse_ledger_table(marked.kind, read_marked_bytes(store, marked), path=marked.path)
    if table.num_rows != marked.rows:
        raise MalformedMarkerError(f"{marked.path} holds {table.num_rows} rows, the commit marker says {marked.rows}")
    return table


def _concat(kind: str, files: Sequence[tuple[MarkedFile, pa.Table]]) -> pa.Table:
    tables = [table for _, table in files]
    return pa.concat_tables(tables) if tables else RECORD_OF_KIND[kind].arrow_schema().empty_table()


def _attempts(files: Sequence[tuple[MarkedFile, pa.Table]]) -> np.ndarray:
    """The attempt of each row's file, row by row."""
    attempts = [layout.attempt_of(marked.path) for marked, _ in files]
    return np.repeat(np.asarray(attempts, np.int64), [table.num_rows for _, table in files])
