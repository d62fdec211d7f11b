"""The writer of one shard attempt's token-free ledger and its commit marker (docs/architecture.md §4.3-4.5, §10).

Invariants it keeps, in the order a crash could break them:

* a call record is added only after its staged segment was written (the caller awaits the
  staging future first), so no ledger row points at data that is not durable;
* every ledger file is created once; a receipt file is written only after every call record
  and failure row added before it is durable, so a receipt on storage implies its manifest is;
* the commit marker is written last and names every object the shard's data lives in,
  including the files of rollouts adopted from earlier attempts (:mod:`tasks.storage.recovery`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from tasks import layout
from tasks.checks import check_int
from tasks.errors import LedgerConflictError
from tasks.ids import check_id
from tasks.records.ledger import CallRecord, FailureRow, Receipt
from tasks.storage.ledger_files import RECORD_OF_KIND, encode_ledger_file
from tasks.storage.marker import MarkedFile, ShardCounts, ShardMarker, parse_shard_object, write_marker
from tasks.storage.objects import ObjectStore
from tasks.storage.recovery import Recovery
from tasks.storage.staging import WrittenSegment

DEFAULT_MAX_ROWS = 1024


class LedgerWriter:
    """Buffered, create-once writer of one shard attempt's ledger files and its commit marker.

    ``store`` is rooted at the batch directory. Rows of each kind are buffered and written as
    ``{kind}-NNNNNN.parquet`` when ``max_rows`` are buffered, on :meth:`flush` and on
    :meth:`commit`; receipts are always written after all calls and failures buffered before
    them. Add a call record only after its staging future resolved; pass :meth:`flush` as the
    staging writer's ``on_committed`` to make records durable after every group commit.
    Rollouts in ``adopted`` (from :func:`~tasks.storage.recovery.recover_earlier_attempts`) are
    committed with their files and cannot be receipted again. Safe to use from several threads.
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
        check_int(max_rows, field="max_rows", minimum=1, error=ValueError)
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
        # Call records of rollouts not yet receipted (for the same-id check); a receipt releases them.
        self._open_calls: dict[str, dict[str, CallRecord]] = {}
        # staging segment -> (rows its call records need, the call that needs the most)
        self._rows_needed: dict[str, tuple[int, str]] = {}
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
            if record.rollout_id in self._receipts:
                raise LedgerConflictError(f"call {record.call_id} arrives after rollout {record.rollout_id}'s receipt")
            calls = self._open_calls.setdefault(record.rollout_id, {})
            known = calls.get(record.call_id)
            if known is not None:
                if known != record:
                    raise LedgerConflictError(
                        f"call {record.call_id} of rollout {record.rollout_id} was already recorded with other content"
                    )
                return
            calls[record.call_id] = record
            needed = (record.staging_row + 1, record.call_id)
            self._rows_needed[record.staging_segment] = max(
                needed, self._rows_needed.get(record.staging_segment, needed)
            )
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
            self._open_calls.pop(receipt.rollout_id, None)
            self._buffer("receipts", receipt)

    def flush(self) -> None:
        """Write every buffered row: calls, then failures, then receipts, under one hold of the lock.

        Writes nothing (no empty file) when nothing is buffered. Safe from any thread; as the
        staging writer's ``on_committed`` hook it runs after that segment's :meth:`add_call` calls,
        so they are durable before the next segment is written. A write that raises leaves its
        rows buffered and the next flush retries the same file first, so a failed flush may
        simply be called again.
        """
        with self._lock:
            self._flush_all()

    def commit(self, *, staging_segments: Iterable[WrittenSegment], carried: Iterable[MarkedFile] = ()) -> ShardMarker:
        """Flush, then write the shard's marker naming every object its data lives in.

        ``staging_segments`` are this attempt's written segments (``StagingWriter.segments``);
        every call record must point at one of them. ``carried``: the objects of earlier attempts
        that hold calls this attempt's rollouts replayed (:func:`~tasks.storage.recovery.carried_files`).
        Committing again returns the same marker.
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
            for segment, (needed, call_id) in self._rows_needed.items():
                if needed > rows_of.get(segment, 0):
                    raise ValueError(
                        f"call {call_id} points at row {needed - 1} of {segment}, "
                        "which the given staging segments do not hold"
                    )
            self._flush_all()
            earlier = {f.path: f for f in (*self._adopted.files, *carried)}
            for path in earlier:
                if parse_shard_object(path, self.shard).attempt >= self.attempt:
                    raise ValueError(f"carried file {path} is not from an attempt before {self.attempt}")
            files = (*staging, *self._written, *earlier.values())
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
