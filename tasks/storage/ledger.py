"""The token-free ledger of a shard: writer, trusted reader and recovery (ARCHITECTURE 4.3-4.5, 10).

Invariants the writer keeps, in the order a crash could break them:

* a call record is added only after its staged segment was written (the caller awaits the
  staging future first), so no ledger row points at data that is not durable;
* every ledger file is created once; a receipt file is written only after every call record
  and failure row added before it is durable, so a receipt on storage implies its manifest is;
* the commit marker is written last and names every object the shard's data lives in.

The reader trusts only what the marker names and checks each ledger file's size and sha256
before parsing it. Recovery reads what an uncommitted attempt left (each object is complete or
absent) and hands its receipted rollouts to the next attempt to adopt.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.capture.records import (
    CallRecord,
    FailureRow,
    Receipt,
)
from tasks.ids import attempt_name, check_id
from tasks.schema import ArrowRecord, all_hold, read_parquet_bytes
from tasks.storage import layout
from tasks.storage.errors import (
    LedgerConflictError,
    MissingStagingRowError,
    SegmentChecksumMismatchError,
    StorageIntegrityError,
    UncommittedShardError,
)
from tasks.storage.marker import (
    MalformedMarkerError,
    MarkedFile,
    ShardCounts,
    ShardMarker,
    parse_shard_object,
    read_marker,
    write_marker,
)
from tasks.storage.objects import ObjectStore, sha256_hex
from tasks.storage.staging import WrittenSegment

DEFAULT_MAX_ROWS = 1024
RECORD_OF_KIND: dict[str, type[ArrowRecord]] = {"calls": CallRecord, "failures": FailureRow, "receipts": Receipt}


class CorruptLedgerFileError(StorageIntegrityError):
    """A ledger object that cannot be parsed or contradicts where it is stored."""

    reason = "corrupt_ledger_file"


class DuplicateReceiptError(StorageIntegrityError):
    """Two receipts for one rollout among the files a shard commits or adopts."""

    reason = "duplicate_receipt"


class ShardAlreadyCommittedError(RuntimeError):
    """Recovery was asked for a shard whose marker exists: there is nothing left to adopt."""


@dataclass(frozen=True)
class RolloutBundle:
    """A receipted rollout with its manifest (call records in ledger order) and failure rows."""

    receipt: Receipt
    manifest: tuple[CallRecord, ...]
    failures: tuple[FailureRow, ...]

    @property
    def rollout_id(self) -> str:
        return self.receipt.rollout_id


@dataclass(frozen=True)
class Recovery:
    """Rollouts that earlier, uncommitted attempts receipted, and every object they need.

    ``files`` names the receipts files, the calls and failures files that hold rows of these
    rollouts, and the staging segments their call records point at.
    """

    rollouts: tuple[RolloutBundle, ...] = ()
    files: tuple[MarkedFile, ...] = ()

    @property
    def rollout_ids(self) -> frozenset[str]:
        return frozenset(b.rollout_id for b in self.rollouts)


def encode_ledger_file(record_cls: type[ArrowRecord], records: Sequence[ArrowRecord]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(record_cls.to_table(records), sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def decode_ledger_file(kind: str, data: bytes, *, path: str) -> list[Any]:
    """Validated records of a ledger file; :class:`CorruptLedgerFileError` naming ``path`` otherwise."""
    return RECORD_OF_KIND[kind].from_checked_table(decode_ledger_table(kind, data, path=path))


def decode_ledger_table(kind: str, data: bytes, *, path: str) -> pa.Table:
    """A ledger file as a table of its record's schema, every row proved valid (:func:`prove_rows`).

    A malformed file raises :class:`CorruptLedgerFileError` naming ``path`` and the problem,
    exactly as constructing its records would.
    """
    table = parse_ledger_table(kind, data, path=path)
    prove_rows(kind, [(path, table)])
    return table


def parse_ledger_table(kind: str, data: bytes, *, path: str) -> pa.Table:
    """A ledger file as a table of its record's schema (columns in schema order); rows not yet proved valid."""
    record_cls = RECORD_OF_KIND[kind]
    try:
        table = read_parquet_bytes(data)
        record_cls.check_table(table, source=path)
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise CorruptLedgerFileError(f"ledger file {path} cannot be read as {kind}: {exc}") from None
    return table.select(record_cls.column_names())


def prove_rows(kind: str, files: Sequence[tuple[str, pa.Table]]) -> None:
    """Prove that every row of the ``kind`` tables (path, table) satisfies its record's invariants.

    All tables are checked column-wise at once (:func:`rows_hold`); when that fails they are
    decoded record by record, so the first malformed file raises
    :class:`CorruptLedgerFileError` naming its path and the record's own complaint.
    """
    tables = [table for _, table in files]
    if not tables or rows_hold(kind, pa.concat_tables(tables)):
        return
    for path, table in files:
        try:
            RECORD_OF_KIND[kind].from_table(table, source=path)
        except (pa.ArrowException, ValueError, TypeError) as exc:
            raise CorruptLedgerFileError(f"ledger file {path} cannot be read as {kind}: {exc}") from None


def rows_hold(kind: str, table: pa.Table) -> bool:
    """Whether every row of a ``kind`` table (its record's schema) satisfies the record's invariants.

    The column-wise form of ``CallRecord`` / ``FailureRow`` / ``Receipt.__post_init__``: it may
    refuse a valid table (the caller then decodes it record by record) but never accepts a
    table one of whose records would refuse to construct (tests/storage/test_ledger.py pins
    this for every rule).
    """
    try:
        table.validate(full=True)  # UTF-8 of every string, as decoding each one would check
        return all_hold(RECORD_OF_KIND[kind].column_rules(table))
    except (pa.ArrowException, ValueError):  # an overflow in a checked sum, an uncheckable value
        return False


class LedgerWriter:
    """Buffered, create-once writer of one shard attempt's ledger files and its commit marker.

    ``store`` is rooted at the batch directory. Rows of each kind are buffered and written as
    ``{kind}-NNNNNN.parquet`` when ``max_rows`` are buffered, on :meth:`flush` and on
    :meth:`commit`; receipts are always written after all calls and failures buffered before
    them. Add a call record only after its staging future resolved. Rollouts in ``adopted``
    (from :func:`recover_earlier_attempts`) are committed with their files and cannot be
    receipted again. Safe to use from several threads.
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        batch_id: str,
        shard: int,
        attempt: int,
        max_rows: int = DEFAULT_MAX_ROWS,
        adopted: Recovery | None = None,
    ) -> None:
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be an int >= 1, got {max_rows!r}")
        layout.ledger_file(shard, attempt, "calls", 0)  # validates shard and attempt
        self.batch_id = check_id(batch_id, field="batch_id")
        self.shard = shard
        self.attempt = attempt
        self._store = store
        self._max_rows = max_rows
        self._adopted = adopted or Recovery()
        self._adopted_ids = self._adopted.rollout_ids
        for marked in self._adopted.files:
            if parse_shard_object(marked.path, shard).attempt >= attempt:
                raise ValueError(f"adopted file {marked.path} is not from an attempt before {attempt}")
        for bundle in self._adopted.rollouts:
            for call in bundle.manifest:
                self._check_batch(call.batch_id, f"adopted call {call.call_id}")
        self._lock = threading.Lock()
        self._pending: dict[str, list[Any]] = {kind: [] for kind in layout.LEDGER_KINDS}
        self._unconfirmed: dict[str, tuple[int, bytes] | None] = dict.fromkeys(layout.LEDGER_KINDS)
        self._next_index = dict.fromkeys(layout.LEDGER_KINDS, 0)
        self._calls: dict[str, CallRecord] = {}
        self._receipts: dict[str, Receipt] = {}
        self._written: list[MarkedFile] = []
        self._marker: ShardMarker | None = None

    @property
    def written_files(self) -> tuple[MarkedFile, ...]:
        """Ledger files this writer created so far, in write order."""
        with self._lock:
            return tuple(self._written)

    def add_call(self, record: CallRecord) -> None:
        """Buffer a call record whose staged delta is already written (its future resolved).

        The same call id again: an identical record is a no-op, a differing one raises
        :class:`LedgerConflictError` naming the call.
        """
        if not isinstance(record, CallRecord):
            raise TypeError(f"add_call takes a CallRecord, got {type(record).__name__}")
        self._check_batch(record.batch_id, f"call {record.call_id}")
        try:
            segment = parse_shard_object(record.staging_segment, self.shard)
        except ValueError as exc:
            raise ValueError(f"call {record.call_id}: staging_segment is not a segment of this shard: {exc}") from None
        if segment.kind != "staging" or segment.attempt != self.attempt:
            raise ValueError(
                f"call {record.call_id}: staging_segment {record.staging_segment} is not a staging segment "
                f"of shard {self.shard} attempt {self.attempt}"
            )
        with self._lock:
            self._check_open()
            known = self._calls.get(record.call_id)
            if known is not None:
                if known != record:
                    raise LedgerConflictError(
                        f"call {record.call_id} of rollout {record.rollout_id} was already recorded with other content"
                    )
                return
            self._calls[record.call_id] = record
            self._buffer("calls", record)

    def add_failure(self, row: FailureRow) -> None:
        """Buffer a failure row (a call that could not be captured)."""
        if not isinstance(row, FailureRow):
            raise TypeError(f"add_failure takes a FailureRow, got {type(row).__name__}")
        self._check_batch(row.batch_id, f"failure row of call {row.call_id}")
        with self._lock:
            self._check_open()
            self._buffer("failures", row)

    def add_receipt(self, receipt: Receipt) -> None:
        """Buffer a rollout's receipt; add it after all of its call records and failure rows.

        A rollout receipted again: identical is a no-op; differing, or already adopted from an
        earlier attempt, raises :class:`LedgerConflictError` naming the rollout.
        """
        if not isinstance(receipt, Receipt):
            raise TypeError(f"add_receipt takes a Receipt, got {type(receipt).__name__}")
        if receipt.attempt != self.attempt:
            raise ValueError(
                f"receipt of {receipt.rollout_id} is for attempt {receipt.attempt}, "
                f"this writer is attempt {self.attempt}"
            )
        if receipt.rollout_id in self._adopted_ids:
            raise LedgerConflictError(f"rollout {receipt.rollout_id} was adopted from an earlier attempt")
        with self._lock:
            self._check_open()
            known = self._receipts.get(receipt.rollout_id)
            if known is not None:
                if known != receipt:
                    raise LedgerConflictError(f"rollout {receipt.rollout_id} already has a different receipt")
                return
            self._receipts[receipt.rollout_id] = receipt
            self._buffer("receipts", receipt)

    def flush(self) -> None:
        """Write every buffered row: calls, then failures, then receipts."""
        with self._lock:
            self._flush_all()

    def commit(self, *, staging_segments: Iterable[WrittenSegment]) -> ShardMarker:
        """Flush, then write the shard's marker naming every object its data lives in.

        ``staging_segments`` are this attempt's written segments (``StagingWriter.segments``);
        every call record must point at one of them. Committing again returns the same marker.
        """
        with self._lock:
            if self._marker is not None:
                return self._marker
            staging = tuple(MarkedFile.of(s.object, kind="staging", rows=s.rows) for s in staging_segments)
            rows_of = {f.path: f.rows for f in staging}
            for marked in staging:
                parsed = parse_shard_object(marked.path, self.shard)
                if parsed.kind != "staging" or parsed.attempt != self.attempt:
                    raise ValueError(
                        f"{marked.path} is not a staging segment of shard {self.shard} attempt {self.attempt}"
                    )
            for call in self._calls.values():
                if call.staging_row >= rows_of.get(call.staging_segment, 0):
                    raise ValueError(
                        f"call {call.call_id} points at row {call.staging_row} of {call.staging_segment}, "
                        "which the given staging segments do not hold"
                    )
            self._flush_all()
            files = (*staging, *self._written, *self._adopted.files)
            receipts = [*self._receipts.values(), *(b.receipt for b in self._adopted.rollouts)]
            statuses = [r.status for r in receipts]

            def rows(kind: str) -> int:
                return sum(f.rows for f in files if f.kind == kind)

            counts = ShardCounts(
                rollouts=len(receipts),
                ok=statuses.count("ok"),
                poisoned=statuses.count("poisoned"),
                failed=statuses.count("failed"),
                calls=rows("calls"),
                failures=rows("failures"),
                staged_rows=rows("staging"),
                adopted_rollouts=len(self._adopted.rollouts),
            )
            marker = ShardMarker(
                batch_id=self.batch_id,
                shard=self.shard,
                attempt=self.attempt,
                files=files,
                counts=counts,
                committed_at=time.time(),
            )
            write_marker(self._store, marker)
            self._marker = marker
            return marker

    def _check_batch(self, batch_id: str, what: str) -> None:
        if batch_id != self.batch_id:
            raise ValueError(f"{what} belongs to batch {batch_id}, this writer writes batch {self.batch_id}")

    def _check_open(self) -> None:
        if self._marker is not None:
            raise RuntimeError(f"shard {self.shard} attempt {self.attempt} is committed; the ledger is closed")

    def _buffer(self, kind: str, record: Any) -> None:
        self._pending[kind].append(record)
        if len(self._pending[kind]) >= self._max_rows:
            # A receipt file may only follow the calls and failures buffered before it.
            for earlier in layout.LEDGER_KINDS[: layout.LEDGER_KINDS.index(kind) + 1]:
                self._flush_kind(earlier)

    def _flush_all(self) -> None:
        for kind in layout.LEDGER_KINDS:
            self._flush_kind(kind)

    def _flush_kind(self, kind: str) -> None:
        """Write buffered rows of ``kind`` in files of at most ``max_rows`` rows.

        A file whose write raised is retried with the same name and bytes before anything
        else: the failed write may have landed, and create-once makes the retry a no-op then.
        """
        pending = self._pending[kind]
        while pending:
            unconfirmed = self._unconfirmed[kind]
            if unconfirmed is None:
                count = min(len(pending), self._max_rows)
                unconfirmed = (count, encode_ledger_file(RECORD_OF_KIND[kind], pending[:count]))
                self._unconfirmed[kind] = unconfirmed
            count, data = unconfirmed
            path = layout.ledger_file(self.shard, self.attempt, kind, self._next_index[kind])
            written = self._store.write_once(path, data)
            self._written.append(MarkedFile.of(written, kind=kind, rows=count))
            self._next_index[kind] += 1
            self._unconfirmed[kind] = None
            del pending[:count]


@dataclass(frozen=True)
class LedgerTables:
    """A committed shard's ledger as checked tables, rows in ledger order (the marker's file order).

    Each table has its record's schema and every row satisfies the record's invariants;
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
                row = _first_differing(table, "batch_id", marker.batch_id)
                if row is not None:
                    raise CorruptLedgerFileError(
                        f"{marked.path}: call {row['call_id']} belongs to batch {row['batch_id']}, "
                        f"the marker commits batch {marker.batch_id}"
                    )
        _check_receipt_attempts(loaded["receipts"])
        self.tables = LedgerTables(
            calls=_concat("calls", loaded["calls"]),
            call_attempts=_attempts(loaded["calls"]),
            failures=_concat("failures", loaded["failures"]),
            failure_attempts=_attempts(loaded["failures"]),
            receipts=_concat("receipts", loaded["receipts"]),
        )
        _check_unique_receipts(self.tables.receipts.column("rollout_id").to_pylist(), where=f"shard {shard}")

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
        calls = _group_by_attempt(self.calls, self.tables.call_attempts.tolist())
        failures = _group_by_attempt(self.failures, self.tables.failure_attempts.tolist())
        for receipt in self.receipts:
            yield _bundle(receipt, calls.get(receipt.attempt, {}), failures.get(receipt.attempt, {}))


def _read_verified(store: ObjectStore, marked: MarkedFile) -> pa.Table:
    """The file's table (rows not yet proved valid), after its size, sha256 and row count checks."""
    try:
        data = store.read_bytes(marked.path)
    except FileNotFoundError:
        raise SegmentChecksumMismatchError(f"{marked.path} is named by the commit marker but missing") from None
    if len(data) != marked.size:
        raise SegmentChecksumMismatchError(
            f"{marked.path} is {len(data)} bytes, the commit marker recorded {marked.size}"
        )
    actual = sha256_hex(data)
    if actual != marked.sha256:
        raise SegmentChecksumMismatchError(
            f"{marked.path} has sha256 {actual}, the commit marker recorded {marked.sha256}"
        )
    table = parse_ledger_table(marked.kind, data, path=marked.path)
    if table.num_rows != marked.rows:
        raise MalformedMarkerError(f"{marked.path} holds {table.num_rows} rows, the commit marker says {marked.rows}")
    return table


def _first_differing(table: pa.Table, name: str, expected: object) -> dict[str, Any] | None:
    """The first row whose ``name`` differs from ``expected``, or None when every row has it."""
    same = pc.fill_null(pc.equal(table.column(name), expected), False)
    if pc.all(same, min_count=0).as_py():
        return None
    index = int(np.flatnonzero(~same.to_numpy(zero_copy_only=False))[0])
    return table.slice(index, 1).to_pylist()[0]


def _concat(kind: str, files: Sequence[tuple[MarkedFile, pa.Table]]) -> pa.Table:
    tables = [table for _, table in files]
    return pa.concat_tables(tables) if tables else RECORD_OF_KIND[kind].arrow_schema().empty_table()


def _attempts(files: Sequence[tuple[MarkedFile, pa.Table]]) -> np.ndarray:
    """The attempt of each row's file, row by row."""
    attempts = [layout.attempt_of(marked.path) for marked, _ in files]
    return np.repeat(np.asarray(attempts, np.int64), [table.num_rows for _, table in files])


def _check_receipt_attempts(files: Iterable[tuple[MarkedFile, pa.Table]]) -> None:
    for marked, receipts in files:
        attempt = layout.attempt_of(marked.path)
        row = _first_differing(receipts, "attempt", attempt)
        if row is not None:
            raise CorruptLedgerFileError(
                f"{marked.path}: receipt of {row['rollout_id']} says attempt {row['attempt']}, "
                f"the file belongs to attempt {attempt}"
            )


def _check_unique_receipts(rollout_ids: Iterable[str], *, where: str) -> None:
    seen: set[str] = set()
    for rollout_id in rollout_ids:
        if rollout_id in seen:
            raise DuplicateReceiptError(f"{where}: rollout {rollout_id} has more than one receipt")
        seen.add(rollout_id)


def _group_by_attempt(records: Iterable[Any], attempts: Iterable[int]) -> dict[int, dict[str, list[Any]]]:
    """attempt -> rollout_id -> rows in ledger order."""
    grouped: dict[int, dict[str, list[Any]]] = {}
    for record, attempt in zip(records, attempts, strict=True):
        grouped.setdefault(attempt, {}).setdefault(record.rollout_id, []).append(record)
    return grouped


def _bundle(receipt: Receipt, calls: dict[str, list[Any]], failures: dict[str, list[Any]]) -> RolloutBundle:
    return RolloutBundle(
        receipt=receipt,
        manifest=tuple(calls.get(receipt.rollout_id, ())),
        failures=tuple(failures.get(receipt.rollout_id, ())),
    )


def read_uncommitted_attempt(store: ObjectStore, shard: int, attempt: int) -> Recovery:
    """The receipted rollouts an uncommitted attempt wrote, and the objects that hold them.

    Lists ``ledger/shard-K/attempt-NN/``, ignoring names that are not ledger files (temp files
    of a crashed local write). Raises :class:`CorruptLedgerFileError` for a file that does not
    parse or whose rows contradict its location, :class:`DuplicateReceiptError`, and
    :class:`MissingStagingRowError` when a receipted call points at a segment that is absent.
    """
    directory = f"{layout.ledger_shard_dir(shard)}/{attempt_name(attempt)}"
    found: dict[str, list[tuple[int, str]]] = {kind: [] for kind in layout.LEDGER_KINDS}
    for path in store.list_files(directory):
        try:
            parsed = parse_shard_object(path, shard)
        except ValueError:
            continue
        found[parsed.kind].append((parsed.index, path))
    loaded: dict[str, list[tuple[MarkedFile, pa.Table]]] = {}
    for kind, indexed in found.items():
        loaded[kind] = []
        for _, path in sorted(indexed):
            data = store.read_bytes(path)
            table = decode_ledger_table(kind, data, path=path)
            marked = MarkedFile(path=path, kind=kind, size=len(data), sha256=sha256_hex(data), rows=table.num_rows)
            loaded[kind].append((marked, table))
    _check_receipt_attempts(loaded["receipts"])
    records = {
        kind: [(marked, RECORD_OF_KIND[kind].from_checked_table(table)) for marked, table in files]
        for kind, files in loaded.items()
    }
    receipts = [r for _, rows in records["receipts"] for r in rows]
    _check_unique_receipts((r.rollout_id for r in receipts), where=f"shard {shard} attempt {attempt}")
    calls, failures = ([r for _, rows in records[kind] for r in rows] for kind in ("calls", "failures"))
    by_rollout = (_group_by_attempt(rows, [attempt] * len(rows)).get(attempt, {}) for rows in (calls, failures))
    calls_of, failures_of = by_rollout
    bundles = tuple(_bundle(r, calls_of, failures_of) for r in receipts)
    receipted = {b.rollout_id for b in bundles}
    files = [marked for marked, _ in loaded["receipts"]]
    for kind in ("calls", "failures"):
        files.extend(marked for marked, rows in records[kind] if any(r.rollout_id in receipted for r in rows))
    segments = sorted({call.staging_segment: call for b in bundles for call in b.manifest}.items())
    for path, call in segments:
        try:
            parsed = parse_shard_object(path, shard)
        except ValueError:
            parsed = None
        if parsed is None or parsed.kind != "staging" or parsed.attempt != attempt:
            raise CorruptLedgerFileError(f"call {call.call_id} of attempt {attempt} points at foreign segment {path}")
        try:
            data = store.read_bytes(path)
        except FileNotFoundError:
            raise MissingStagingRowError(f"call {call.call_id} points at segment {path}, which is absent") from None
        rows = pq.read_metadata(pa.BufferReader(data)).num_rows
        files.append(MarkedFile(path=path, kind="staging", size=len(data), sha256=sha256_hex(data), rows=rows))
    return Recovery(rollouts=bundles, files=tuple(files))


def recover_earlier_attempts(store: ObjectStore, shard: int, *, attempt: int) -> Recovery:
    """Everything attempts before ``attempt`` receipted, for attempt ``attempt`` to adopt.

    Refuses a committed shard (:class:`ShardAlreadyCommittedError`) and a rollout receipted by
    two attempts (:class:`DuplicateReceiptError`).
    """
    if read_marker(store, shard) is not None:
        raise ShardAlreadyCommittedError(f"shard {shard} is already committed; nothing to recover")
    parts = [read_uncommitted_attempt(store, shard, earlier) for earlier in range(attempt)]
    rollouts = tuple(b for part in parts for b in part.rollouts)
    _check_unique_receipts((b.rollout_id for b in rollouts), where=f"shard {shard} attempts before {attempt}")
    return Recovery(rollouts=rollouts, files=tuple(f for part in parts for f in part.files))
