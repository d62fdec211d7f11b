"""The writer of one shard attempt's token-free ledger and its commit marker (docs/architecture.md §4.3-4.5, §10).

Invariants it keeps, in the order a crash could break them:

* a call record is added only after its staged segment was written (the caller awaits the
  staging future first), so no ledger row points at data that is not durable;
* every ledger file is created once; a receipt file is written only after every call record
  and failure row added before it is durable, so a receipt on storage implies its manifest is;
* the commit marker is written last and names every object the shard's data lives in,
  including the files of rollouts adopted from earlier attempts (:mod:`tasks.storage.recovery`);
  its ``calls_used`` counts the calls of the receipts' manifests (this attempt's and the adopted
  ones) among the rows the marker names, by the one manifest rule (:func:`_calls_used`);
* at commit, a kind of row this attempt wrote in more files than ``max_rows`` per file needs
  (one file per staging group commit, say) is rewritten into compacted files
  (``{kind}-compacted-NNNNNN.parquet``: the same rows in the same order, ``max_rows`` a file,
  calls, then failures, then receipts), and the marker names those instead of the small files,
  which the sweep then deletes. Recovery never reads a compacted file (only its own attempt's
  marker makes it valid), so an attempt that dies before its marker is recovered from its small
  files alone. Files of earlier attempts are named as they are, never rewritten. The rows to
  compact are kept as they were encoded for the small files (Arrow tables, encoded into
  compressed Parquet as each ``max_rows`` fill up), never as records.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks import layout
from tasks.checks import check_int
from tasks.errors import LedgerConflictError
from tasks.ids import check_id
from tasks.records.ledger import CallRecord, FailureRow, Receipt
from tasks.storage.ledger_files import RECORD_OF_KIND
from tasks.storage.marker import (
    MarkedFile,
    ShardCounts,
    ShardMarker,
    calls_in_manifests,
    parse_shard_object,
    write_marker,
)
from tasks.storage.objects import ObjectStore
from tasks.storage.recovery import Recovery
from tasks.storage.rollout_manifest import receipts_table
from tasks.storage.staging import WrittenSegment

DEFAULT_MAX_ROWS = 1024


class LedgerWriter:
    """Buffered, create-once writer of one shard attempt's ledger files and its commit marker.

    ``store`` is rooted at the batch directory. Rows of each kind are buffered and written as
    ``{kind}-NNNNNN.parquet`` when ``max_rows`` are buffered, on :meth:`flush` and on
    :meth:`commit`; receipts are always written after all calls and failures buffered before
    them. Add a call record only after its staging future resolved; pass :meth:`flush` as the
    staging writer's ``on_committed`` to make records durable after every group commit.
    With ``compact`` (the default), :meth:`commit` rewrites a kind written in more files than
    needed into compacted files of ``max_rows`` rows (module docstring). Rollouts in ``adopted``
    (from :func:`~tasks.storage.recovery.recover_earlier_attempts`) are committed with their
    files and cannot be receipted again. Safe to use from several threads.
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
        compact: bool = True,
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
            self._check_earlier(marked.path, "adopted")
        for bundle in self._adopted.rollouts:
            for call in bundle.manifest:
                self._check_batch(call.batch_id, f"adopted call {call.call_id}")
        self._compact = compact
        self._lock = threading.Lock()
        self._pending: dict[str, list[Any]] = {kind: [] for kind in layout.LEDGER_KINDS}
        # A file whose write raised: (rows, bytes, table), retried first with the same name and bytes.
        self._unconfirmed: dict[str, tuple[int, bytes, pa.Table] | None] = dict.fromkeys(layout.LEDGER_KINDS)
        self._small: dict[str, list[MarkedFile]] = {kind: [] for kind in layout.LEDGER_KINDS}
        # What compaction would write: full files of max_rows rows as encoded bytes, then the rows
        # written since as tables (less than max_rows); only with ``compact``.
        self._chunks: dict[str, list[tuple[int, bytes]]] = {kind: [] for kind in layout.LEDGER_KINDS}
        self._tail: dict[str, list[pa.Table]] = {kind: [] for kind in layout.LEDGER_KINDS}
        self._tail_rows = dict.fromkeys(layout.LEDGER_KINDS, 0)
        self._compacted: dict[str, list[MarkedFile]] = {kind: [] for kind in layout.LEDGER_KINDS}
        self._sealed = False  # commit began: no more rows; a failed commit may only be retried
        # Call records of rollouts not yet receipted (for the same-id check); a receipt releases them.
        self._open_calls: dict[str, dict[str, CallRecord]] = {}
        # (rollout_id, call_id) of every call record this attempt buffered, in ledger order (for calls_used).
        self._call_keys: list[tuple[str, str]] = []
        # staging segment -> (rows its call records need, the call that needs the most)
        self._rows_needed: dict[str, tuple[int, str]] = {}
        self._receipts: dict[str, Receipt] = {}
        self._written: list[MarkedFile] = []
        self._committed_at: float | None = None
        self._marker: ShardMarker | None = None

    @property
    def written_files(self) -> tuple[MarkedFile, ...]:
        """Ledger files this writer created so far, in write order: the compacted ones (if any) come last."""
        with self._lock:
            return tuple(self._written)

    @property
    def held_for_compaction(self) -> int:
        """Bytes this writer holds for compaction at commit: the encoded full files and the tables since."""
        with self._lock:
            encoded = sum(len(data) for chunks in self._chunks.values() for _, data in chunks)
            return encoded + sum(t.get_total_buffer_size() for tail in self._tail.values() for t in tail)

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
            self._call_keys.append((record.rollout_id, record.call_id))
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
        """Flush, compact, then write the shard's marker naming every object its data lives in.

        ``staging_segments`` are this attempt's written segments (``StagingWriter.segments``);
        every call record must point at one of them. ``carried``: the objects of earlier attempts
        that hold calls this attempt's rollouts replayed (:func:`~tasks.storage.recovery.carried_files`).
        Once the arguments pass their checks the ledger takes no more rows; a commit that raised
        after that (a failed write) may be called again and retries the same files with the same
        bytes, and the same marker. Committing again returns the same marker.
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
            earlier = {f.path: f for f in (*self._adopted.files, *carried)}
            for path in earlier:
                self._check_earlier(path, "carried")
            self._sealed = True
            self._flush_all()
            files = (*staging, *self._own_files(), *earlier.values())
            receipts = [*self._receipts.values(), *(b.receipt for b in self._adopted.rollouts)]
            statuses = [r.status for r in receipts]

            def rows(kind: str) -> int:
                return sum(f.rows for f in files if f.kind == kind)

            counts = ShardCounts(
                rollouts=len(receipts),
                ok=statuses.count("ok"),
                poisoned=statuses.count("poisoned"),
                failed=statuses.count("failed"),
                calls_recorded=rows("calls"),
                calls_used=self._calls_used(receipts, {f.path for f in files}),
                failures=rows("failures"),
                staged_rows=rows("staging"),
                adopted_rollouts=len(self._adopted.rollouts),
            )
            if self._committed_at is None:  # a retried commit writes the same marker
                self._committed_at = time.time()
            marker = ShardMarker(
                batch_id=self.batch_id,
                shard=self.shard,
                attempt=self.attempt,
                files=files,
                counts=counts,
                committed_at=self._committed_at,
            )
            write_marker(self._store, marker)
            self._marker = marker
            for kind in layout.LEDGER_KINDS:  # committed: nothing is compacted any more
                self._chunks[kind].clear()
                self._tail[kind].clear()
                self._tail_rows[kind] = 0
            return marker

    def _calls_used(self, receipts: Sequence[Receipt], named: set[str]) -> int:
        """The marker's ``calls_used``: calls in the manifests of ``receipts`` (this attempt's and the adopted
        ones), each once, over the call rows the marker names that a manifest can hold.

        Those rows are this attempt's call records and, of earlier attempts, the adopted rollouts' manifests and
        the calls of the rollouts no earlier attempt receipted, each in a file the marker names (which holds the
        calls this attempt's receipts replayed); the named files' other rows belong to no manifest. The rule
        is :func:`~tasks.storage.rollout_manifest.rollout_manifests`, which reads the committed ledger alike.
        """
        earlier: dict[int, tuple[CallRecord, int]] = {}
        for bundle in self._adopted.rollouts:
            for call in bundle.manifest:
                earlier.setdefault(id(call), (call, layout.attempt_of(call.staging_segment)))
        for committed in (c for calls in self._adopted.unreceipted.values() for c in calls):
            if committed.calls_file.path in named:
                earlier.setdefault(id(committed.record), (committed.record, committed.attempt))
        keys = [(call.rollout_id, call.call_id) for call, _ in earlier.values()] + self._call_keys
        calls = pa.table(
            {
                "rollout_id": pa.array([rollout for rollout, _ in keys], pa.string()),
                "call_id": pa.array([call for _, call in keys], pa.string()),
            }
        )
        attempts = np.asarray([a for _, a in earlier.values()] + [self.attempt] * len(self._call_keys), np.int64)
        return calls_in_manifests(calls, attempts, receipts_table(receipts))

    def _check_batch(self, batch_id: str, what: str) -> None:
        if batch_id != self.batch_id:
            raise ValueError(f"{what} belongs to batch {batch_id}, this writer writes batch {self.batch_id}")

    def _check_earlier(self, path: str, what: str) -> None:
        parsed = parse_shard_object(path, self.shard)
        if parsed.attempt >= self.attempt:
            raise ValueError(f"{what} file {path} is not from an attempt before {self.attempt}")
        if parsed.compacted:
            raise ValueError(f"{what} file {path} is a compacted file, valid only in its own attempt's marker")

    def _check_open(self) -> None:
        if self._marker is not None or self._sealed:
            raise RuntimeError(
                f"shard {self.shard} attempt {self.attempt} is committing or committed; the ledger is closed"
            )

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
                table = RECORD_OF_KIND[kind].to_table(pending[:count])
                unconfirmed = (count, _encode(table), table)
                self._unconfirmed[kind] = unconfirmed
            count, data, table = unconfirmed
            path = layout.ledger_file(self.shard, self.attempt, kind, len(self._small[kind]))
            marked = MarkedFile.of(self._store.write_once(path, data), kind=kind, rows=count)
            self._small[kind].append(marked)
            self._written.append(marked)
            self._unconfirmed[kind] = None
            del pending[:count]
            if self._compact:
                self._keep(kind, table)

    def _keep(self, kind: str, table: pa.Table) -> None:
        """Add a written file's rows to what compaction would write; encode each ``max_rows`` as they fill up."""
        tail = self._tail[kind]
        tail.append(table)
        self._tail_rows[kind] += table.num_rows
        while self._tail_rows[kind] >= self._max_rows:
            combined = pa.concat_tables(tail)
            self._chunks[kind].append((self._max_rows, _encode(combined.slice(0, self._max_rows))))
            rest = combined.slice(self._max_rows)
            tail[:] = [rest] if rest.num_rows else []
            self._tail_rows[kind] = rest.num_rows

    def _own_files(self) -> list[MarkedFile]:
        """This attempt's ledger files the marker names: per kind, its compacted files where compaction
        saves files (writing whichever are not yet written), else its small files."""
        named: list[MarkedFile] = []
        for kind in layout.LEDGER_KINDS:
            chunks, tail = self._chunks[kind], self._tail[kind]
            needed = len(chunks) + (1 if tail else 0)
            if not self._compact or len(self._small[kind]) <= needed:
                named.extend(self._small[kind])
                continue
            if tail:  # sealed: the tail is final, and a retried commit finds it among the chunks
                rest = pa.concat_tables(tail)
                chunks.append((rest.num_rows, _encode(rest)))
                tail.clear()
                self._tail_rows[kind] = 0
            compacted = self._compacted[kind]
            for index in range(len(compacted), len(chunks)):
                rows, data = chunks[index]
                path = layout.ledger_file(self.shard, self.attempt, kind, index, compacted=True)
                marked = MarkedFile.of(self._store.write_once(path, data), kind=kind, rows=rows)
                compacted.append(marked)
                self._written.append(marked)
            named.extend(compacted)
        return named


def _encode(table: pa.Table) -> bytes:
    """A ledger file's bytes (as :func:`~tasks.storage.ledger_files.encode_ledger_file` encodes records)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()
