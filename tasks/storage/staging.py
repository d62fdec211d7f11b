"""Group-commit staging of token deltas (docs/architecture.md §4.1, §5); :mod:`.staged_reader` reads them back.

Writer invariant: a submitted delta's :class:`CommitCoordinates` resolve only after the
segment object holding it has been written (``write_once`` returned), so a ledger record
written on those coordinates never points at data that is not durable. Every flush attempt
takes a fresh segment index: a failed write may have left a partial object or even a whole
one, so its name is never used again.

Commit hook invariant: ``on_committed`` runs in the writer thread after a segment was written and
every future of it resolved, so every done-callback attached to those futures before they
resolved (``submit``'s ``done_callback`` always is) has returned; a hook that flushes the ledger
makes every call record of that segment durable before the next segment is written.

Reader invariant: rows come back only from segments whose bytes match the committed sha256
(when given) and whose schema is the :class:`StagedDelta` schema, and only when the row at
the coordinates holds the requested ``rollout_id/call_id``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.checks import check_finite, check_int
from tasks.crash_points import crash_point
from tasks.errors import (
    DuplicateStagingKeyError,
)
from tasks.layout import staging_segment
from tasks.records.ledger import StagedDelta
from tasks.storage.objects import ObjectStore, WrittenObject

log = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 512
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_DELAY_MS = 50.0

# Fixed per-row cost (hex hashes, ids, sampling columns) in the buffered-bytes estimate.
_ROW_OVERHEAD_BYTES = 400
# Bytes per token of the three list columns before encoding: int64 id + float32 mask + float32 logprob.
_TOKEN_BYTES = 16

_HASH_COLUMNS = ("extras_digest", "chain_hash", "cumulative_hash", "digest")
# Encodings, measured with bench/staging.py (bytes per staged token, zstd; pyarrow defaults 7.9):
# * token ids and logprobs: BYTE_STREAM_SPLIT, no dictionary. Splitting the bytes of each value
#   into streams leaves the always-zero high bytes of int64 ids and the near-constant sign /
#   exponent bytes of near-zero logprobs in runs zstd removes (ids 2.06 -> 1.90 B/token against
#   the default dictionary, logprobs 4.87 -> 3.05; a 49k vocabulary overflows a useful dictionary).
# * hashes: plain, no dictionary: every value is unique, a dictionary only adds a page.
# * everything else (mask runs, repeated ids and sampling values): dictionary + RLE, the default.
# Statistics are off: nothing filters staging segments by value. Result: ~5.7 B/token.
_PLAIN_COLUMNS = (*_HASH_COLUMNS, "token_ids_delta", "logprobs_delta")
_COLUMN_ENCODING = {
    "token_ids_delta.list.element": "BYTE_STREAM_SPLIT",
    "logprobs_delta.list.element": "BYTE_STREAM_SPLIT",
}


@dataclass(frozen=True)
class CommitCoordinates:
    """Where a staged delta lives: a batch-relative segment path and the row within it."""

    segment: str
    row: int


@dataclass(frozen=True)
class WrittenSegment:
    """A written segment object and its row count, as the shard's commit marker lists it."""

    object: WrittenObject
    rows: int


def encode_segment(table: pa.Table, *, compression: str = "zstd") -> bytes:
    """Parquet bytes of a staged-delta table with the staging encodings (one row group)."""
    sink = pa.BufferOutputStream()
    use_dictionary = [name for name in table.column_names if name not in _PLAIN_COLUMNS]
    pq.write_table(
        table,
        sink,
        compression=compression,
        use_dictionary=use_dictionary,
        column_encoding=_COLUMN_ENCODING,
        write_statistics=False,
    )
    return sink.getvalue().to_pybytes()


@dataclass
class _Pending:
    delta: StagedDelta
    future: Future[CommitCoordinates]
    nbytes: int
    seq: int
    submitted_at: float


@dataclass
class _State:
    buffer: list[_Pending] = field(default_factory=list)
    buffered_bytes: int = 0
    keys: set[str] = field(default_factory=set)
    next_seq: int = 0
    flush_through: int = -1
    in_flight: list[Future[CommitCoordinates]] = field(default_factory=list)
    segments: list[WrittenSegment] = field(default_factory=list)
    next_index: int = 0
    closing: bool = False
    hook_error: Exception | None = None
    hook_failures: int = 0  # consecutive failed calls of on_committed


class StagingWriter:
    """Group-commit writer of one shard attempt's staging segments.

    ``store`` is rooted at the batch directory. A background thread writes the buffered
    deltas as one Parquet segment when ``max_rows`` rows or about ``max_bytes`` uncompressed
    bytes are buffered, or ``max_delay_ms`` after the oldest buffered row was submitted.
    A staging key is accepted at most once per writer, also after its flush failed (the
    failed call is recorded as a failure row; a retry is a new call id).

    ``on_committed`` (e.g. ``LedgerWriter.flush``) is called in the writer thread once per written
    segment, after all of its futures resolved and their done-callbacks returned, and before the
    next segment is written: its time delays the next group commit (which then takes more rows).
    It is not called after a failed write (no future of it resolved). An exception from it is
    logged (the first of a run of failures with its traceback) and kept in
    :attr:`on_committed_error`, and the next segment's call retries: it fails no future, since the
    segments it follows and precedes are durable, and failing their calls would poison rollouts
    whose data is intact. A hook that keeps failing surfaces where it is called last (the
    caller's final ``LedgerWriter.flush`` or ``commit`` after :meth:`close`).
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        shard: int,
        attempt: int,
        max_rows: int = DEFAULT_MAX_ROWS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_delay_ms: float = DEFAULT_MAX_DELAY_MS,
        compression: str = "zstd",
        on_committed: Callable[[], None] | None = None,
    ) -> None:
        check_int(max_rows, field="max_rows", minimum=1, error=ValueError)
        check_int(max_bytes, field="max_bytes", minimum=1, error=ValueError)
        if check_finite(max_delay_ms, field="max_delay_ms", error=ValueError) < 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {max_delay_ms!r}")
        staging_segment(shard, attempt, 0)  # validates shard and attempt up front
        self._store = store
        self._shard = shard
        self._attempt = attempt
        self._max_rows = max_rows
        self._max_bytes = max_bytes
        self._max_delay = max_delay_ms / 1000.0
        self._compression = compression
        self._on_committed = on_committed
        self._state = _State()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"staging-writer-{shard}-{attempt}", daemon=True)
        self._thread.start()

    def __enter__(self) -> StagingWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def segments(self) -> list[WrittenSegment]:
        """Every segment written so far, in index order."""
        with self._cond:
            return list(self._state.segments)

    @property
    def on_committed_error(self) -> Exception | None:
        """The error of the latest ``on_committed`` call if it raised; None once a later call succeeded."""
        with self._cond:
            return self._state.hook_error

    def submit(
        self,
        delta: StagedDelta,
        *,
        done_callback: Callable[[Future[CommitCoordinates]], object] | None = None,
    ) -> Future[CommitCoordinates]:
        """Buffer ``delta``; the future resolves with its coordinates once its segment is written.

        The future fails with :class:`DuplicateStagingKeyError` for a key this writer already
        accepted, and with the write error when its segment could not be written.
        ``done_callback`` is attached before the delta is buffered, so it runs in the writer thread
        before its segment's ``on_committed`` hook; one attached to the returned future afterwards
        may run later, in the attaching thread, if the segment was written in between.
        """
        if not isinstance(delta, StagedDelta):
            raise TypeError(f"submit takes a StagedDelta, got {type(delta).__name__}")
        future: Future[CommitCoordinates] = Future()
        if done_callback is not None:
            future.add_done_callback(done_callback)
        nbytes = _TOKEN_BYTES * delta.delta_len + len(delta.extras_json) + _ROW_OVERHEAD_BYTES
        with self._cond:
            if self._state.closing:
                raise RuntimeError(f"staging writer of shard {self._shard} attempt {self._attempt} is closed")
            state = self._state
            if delta.staging_key in state.keys:
                future.set_exception(
                    DuplicateStagingKeyError(f"staging key {delta.staging_key} was already submitted to this writer")
                )
                return future
            state.keys.add(delta.staging_key)
            state.buffer.append(_Pending(delta, future, nbytes, state.next_seq, time.monotonic()))
            state.next_seq += 1
            state.buffered_bytes += nbytes
            # Wake the flusher only when it has something new to do: arm the delay timer for a
            # first row, or flush on size. Waking it per row costs more than the write itself.
            if len(state.buffer) == 1 or len(state.buffer) >= self._max_rows or state.buffered_bytes >= self._max_bytes:
                self._cond.notify_all()
        return future

    def flush(self) -> None:
        """Write everything submitted so far and wait until it is written or has failed.

        Failures are reported through the submissions' futures, not raised here. The last
        segment's ``on_committed`` call may still be running when this returns (:meth:`close`
        waits for it).
        """
        with self._cond:
            state = self._state
            waiting = [p.future for p in state.buffer] + list(state.in_flight)
            state.flush_through = state.next_seq - 1
            self._cond.notify_all()
        for future in waiting:
            future.exception()

    def close(self) -> None:
        """Flush, then stop the writer thread once the last ``on_committed`` call returned.

        Idempotent; ``submit`` raises afterwards.
        """
        with self._cond:
            self._state.closing = True
            self._cond.notify_all()
        self._thread.join()

    # --- flusher thread -------------------------------------------------------------------

    def _due(self, now: float) -> bool:
        state = self._state
        if not state.buffer:
            return False
        return (
            state.closing
            or len(state.buffer) >= self._max_rows
            or state.buffered_bytes >= self._max_bytes
            or state.buffer[0].seq <= state.flush_through
            or now - state.buffer[0].submitted_at >= self._max_delay
        )

    def _run(self) -> None:
        while True:
            with self._cond:
                state = self._state
                while not self._due(time.monotonic()):
                    if state.closing and not state.buffer:
                        return
                    timeout = None
                    if state.buffer:
                        timeout = max(0.0, state.buffer[0].submitted_at + self._max_delay - time.monotonic())
                    self._cond.wait(timeout)
                batch = self._take_batch()
                if not batch:
                    continue
                index = state.next_index
                state.next_index += 1
            self._write(batch, index)

    def _take_batch(self) -> list[_Pending]:
        """Pop the oldest rows, up to ``max_rows`` rows and about ``max_bytes`` (at least one row)."""
        state = self._state
        count, nbytes = 0, 0
        while count < len(state.buffer) and count < self._max_rows and (count == 0 or nbytes < self._max_bytes):
            nbytes += state.buffer[count].nbytes
            count += 1
        batch, state.buffer = state.buffer[:count], state.buffer[count:]
        state.buffered_bytes -= nbytes
        live = [p for p in batch if p.future.set_running_or_notify_cancel()]
        state.in_flight = [p.future for p in live]
        return live

    def _write(self, batch: list[_Pending], index: int) -> None:
        path = staging_segment(self._shard, self._attempt, index)
        try:
            data = encode_segment(StagedDelta.to_table([p.delta for p in batch]), compression=self._compression)
            written = self._store.write_once(path, data)
            crash_point("segment_written", path)
        except Exception as exc:
            for pending in batch:
                pending.future.set_exception(exc)
            committed = False
        else:
            with self._cond:
                self._state.segments.append(WrittenSegment(written, len(batch)))
            for row, pending in enumerate(batch):
                pending.future.set_result(CommitCoordinates(path, row))  # runs its done-callbacks here
            committed = True
        with self._cond:
            self._state.in_flight = []
        if committed and self._on_committed is not None:
            self._run_on_committed(self._on_committed, path)

    def _run_on_committed(self, hook: Callable[[], None], path: str) -> None:
        """Call the hook after segment ``path``; log and keep its error (see the class docstring), never raise."""
        try:
            hook()
        except Exception as exc:
            with self._cond:
                state = self._state
                state.hook_error = exc
                state.hook_failures += 1
                failures = state.hook_failures
            if failures == 1:
                log.error(
                    "staging shard %d attempt %d: on_committed failed after %s; retried after the next segment",
                    self._shard,
                    self._attempt,
                    path,
                    exc_info=True,
                )
            return
        with self._cond:
            state = self._state
            failures, state.hook_failures, state.hook_error = state.hook_failures, 0, None
        if failures:
            log.warning(
                "staging shard %d attempt %d: on_committed succeeded after %s, following %d failed calls",
                self._shard,
                self._attempt,
                path,
                failures,
            )
