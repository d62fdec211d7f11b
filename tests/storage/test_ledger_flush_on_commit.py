"""The ledger flushed after every group commit: StagingWriter's ``on_committed`` hook and LedgerWriter.flush.

A crash loses at most the call records of the last group commit: the hook runs once every future
of a written segment resolved (so every ``add_call`` of that segment has run), a failing hook is
logged and retried after the next segment without failing a call, and nothing pending writes no file.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from tasks import layout
from tasks.ids import rollout_id
from tasks.records.ledger import StagedDelta
from tasks.storage.ledger_files import decode_ledger_file
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.marker import parse_shard_object
from tasks.storage.objects import ObjectStore, WrittenObject
from tasks.storage.staging import CommitCoordinates, StagingWriter

from ._writer_process import BATCH, make_call, make_chain, make_receipt
from .markers import SHARD

NEVER_MS = 3_600_000.0  # a delay threshold that never fires within a test


def rows_of(store: ObjectStore, path: str) -> list[Any]:
    return decode_ledger_file(parse_shard_object(path, SHARD).kind, store.read_bytes(path), path=path)


def add_call_when_staged(ledger: LedgerWriter, delta: StagedDelta) -> Callable[[Future[CommitCoordinates]], None]:
    """The done-callback CallRecorder.record attaches: the call record goes to the ledger in the writer thread."""

    def callback(future: Future[CommitCoordinates]) -> None:
        ledger.add_call(make_call(delta, future.result()))

    return callback


class FailingLedgerWrites:
    """Forwards to a store; the first ``failures`` writes of calls files raise before writing anything."""

    def __init__(self, inner: ObjectStore, failures: int) -> None:
        self.inner = inner
        self.failures = failures

    def write_once(self, relative: str, data: bytes) -> WrittenObject:
        if "/calls-" in relative and self.failures > 0:
            self.failures -= 1
            raise PermissionError(f"refused {relative}")
        return self.inner.write_once(relative, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_hook_runs_after_every_call_record_of_its_segment_was_added(mem_batch: ObjectStore) -> None:
    ledger = LedgerWriter(mem_batch, batch_id=BATCH, shard=SHARD, attempt=0)
    seen: list[list[str]] = []  # per hook call: the call ids durable in the ledger

    def flush_and_look() -> None:
        ledger.flush()
        seen.append([r.call_id for f in ledger.written_files for r in rows_of(mem_batch, f.path)])

    deltas = [make_chain(rollout_id(n, 0), 1)[0] for n in range(10)]
    with StagingWriter(
        mem_batch, shard=SHARD, attempt=0, max_rows=4, max_delay_ms=NEVER_MS, on_committed=flush_and_look
    ) as staging:
        futures = [staging.submit(d, done_callback=add_call_when_staged(ledger, d)) for d in deltas]
    segment_of = [f.result().segment for f in futures]
    ids_by_segment = [
        [d.call_id for d, at in zip(deltas, segment_of, strict=True) if at == s.object.path] for s in staging.segments
    ]
    assert [len(ids) for ids in ids_by_segment] == [4, 4, 2]
    # Hook k sees the records of segments 0..k durable: every one of its own segment, none of a later one.
    assert seen == [[i for ids in ids_by_segment[: k + 1] for i in ids] for k in range(3)]
    assert [f.rows for f in ledger.written_files] == [4, 4, 2]
    assert staging.on_committed_error is None


def test_done_callback_attached_after_submit_runs_before_the_hook_when_the_segment_is_not_yet_written(
    mem_batch: ObjectStore,
) -> None:
    """The way CallRecorder.record attaches its callback today: safe while the segment is still buffered."""
    ledger = LedgerWriter(mem_batch, batch_id=BATCH, shard=SHARD, attempt=0)
    deltas = [make_chain(rollout_id(n, 0), 1)[0] for n in range(3)]
    with StagingWriter(mem_batch, shard=SHARD, attempt=0, max_delay_ms=NEVER_MS, on_committed=ledger.flush) as staging:
        for delta in deltas:
            staging.submit(delta).add_done_callback(add_call_when_staged(ledger, delta))
    (calls,) = ledger.written_files
    assert [r.call_id for r in rows_of(mem_batch, calls.path)] == [d.call_id for d in deltas]


def test_failing_hook_is_logged_fails_no_call_and_is_retried_after_the_next_segment(
    mem_batch: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = LedgerWriter(FailingLedgerWrites(mem_batch, failures=2), batch_id=BATCH, shard=SHARD, attempt=0)  # type: ignore[arg-type]
    outcomes: list[str] = []
    returned = threading.Semaphore(0)

    def flush() -> None:
        try:
            ledger.flush()
            outcomes.append("ok")
        except PermissionError:
            outcomes.append("failed")
            raise
        finally:
            returned.release()

    deltas = [make_chain(rollout_id(n, 0), 1)[0] for n in range(4)]
    caplog.set_level(logging.WARNING, logger="tasks.storage.staging")
    with StagingWriter(mem_batch, shard=SHARD, attempt=0, max_delay_ms=NEVER_MS, on_committed=flush) as staging:
        for step, delta in enumerate(deltas):
            future = staging.submit(delta, done_callback=add_call_when_staged(ledger, delta))
            staging.flush()
            assert future.result().segment == layout.staging_segment(SHARD, 0, step)  # no call is failed
            assert returned.acquire(timeout=10)
            assert len(ledger.written_files) == (0 if step < 2 else step)
    assert outcomes == ["failed", "failed", "ok", "ok"]
    assert staging.on_committed_error is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None  # one traceback per run of failures
    assert f"on_committed failed after {layout.staging_segment(SHARD, 0, 0)}" in errors[0].getMessage()
    assert any("following 2 failed calls" in r.getMessage() for r in caplog.records)
    # The retry wrote the first file with the row buffered when it first failed; nothing was lost or reordered.
    files = ledger.written_files
    assert [f.path for f in files] == [layout.ledger_file(SHARD, 0, "calls", i) for i in range(3)]
    assert [[r.call_id for r in rows_of(mem_batch, f.path)] for f in files] == [
        [deltas[0].call_id],
        [deltas[1].call_id, deltas[2].call_id],
        [deltas[3].call_id],
    ]


def test_hook_that_keeps_failing_leaves_staging_working_and_its_error_to_the_final_flush(
    mem_batch: ObjectStore,
) -> None:
    ledger = LedgerWriter(FailingLedgerWrites(mem_batch, failures=99), batch_id=BATCH, shard=SHARD, attempt=0)  # type: ignore[arg-type]
    deltas = [make_chain(rollout_id(n, 0), 1)[0] for n in range(3)]
    with StagingWriter(mem_batch, shard=SHARD, attempt=0, max_rows=1, on_committed=ledger.flush) as staging:
        futures = [staging.submit(d, done_callback=add_call_when_staged(ledger, d)) for d in deltas]
    assert [f.result().row for f in futures] == [0, 0, 0] and len(staging.segments) == 3
    assert isinstance(staging.on_committed_error, PermissionError)
    with pytest.raises(PermissionError, match="calls-000000"):
        ledger.flush()


def test_hook_with_nothing_pending_writes_no_ledger_file(mem_batch: ObjectStore) -> None:
    ledger = LedgerWriter(mem_batch, batch_id=BATCH, shard=SHARD, attempt=0)
    chain = make_chain(rollout_id(0, 0), 2)
    with StagingWriter(mem_batch, shard=SHARD, attempt=0, max_delay_ms=NEVER_MS, on_committed=ledger.flush) as staging:
        first = staging.submit(chain[0])  # staged, its record never added: the hook has nothing to write
        staging.flush()
        staging.submit(chain[1], done_callback=add_call_when_staged(ledger, chain[1]))
        staging.flush()
        ledger.add_receipt(make_receipt(chain[0].rollout_id, chain[1].call_id))
        staging.submit(make_chain(rollout_id(1, 0), 1)[0])
    assert first.result().segment == layout.staging_segment(SHARD, 0, 0)
    assert len(staging.segments) == 3
    assert [(f.kind, f.rows) for f in ledger.written_files] == [("calls", 1), ("receipts", 1)]
    assert mem_batch.list_files(layout.ledger_shard_dir(SHARD)) == [f.path for f in ledger.written_files]


def test_receipts_never_precede_their_calls_with_the_hook_and_receipts_from_other_threads(tmp_path) -> None:
    """Eight rollouts of three calls each, their receipts added from their own threads while the hook flushes."""
    store = ObjectStore(str(tmp_path / "batch"))
    ledger = LedgerWriter(store, batch_id=BATCH, shard=SHARD, attempt=0)
    chains = {rollout_id(n, 0): make_chain(rollout_id(n, 0), 3) for n in range(8)}

    def run_rollout(staging: StagingWriter, chain: list[StagedDelta]) -> None:
        for delta in chain:
            staging.submit(delta, done_callback=add_call_when_staged(ledger, delta)).result(timeout=60)
        ledger.add_receipt(make_receipt(chain[0].rollout_id, chain[-1].call_id))

    staging = StagingWriter(store, shard=SHARD, attempt=0, max_delay_ms=1.0, on_committed=ledger.flush)
    with staging, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda chain: run_rollout(staging, chain), chains.values()))
    ledger.commit(staging_segments=staging.segments)
    durable: set[str] = set()
    for marked in ledger.written_files:
        for row in rows_of(store, marked.path):
            if marked.kind == "calls":
                durable.add(row.call_id)
            else:
                assert {d.call_id for d in chains[row.rollout_id]} <= durable, row.rollout_id
    assert len(durable) == 24
    reader = LedgerReader(store, SHARD)
    assert len(reader.calls) == 24 and len(reader.receipts) == 8
    assert len(ledger.written_files) > 2  # flushed along the way, not only at the end
