"""The ledger writer: receipts after their manifests, the marker last, conflicts refused (architecture.md §4.3-4.5)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks import layout
from tasks.errors import LedgerConflictError, ObjectConflictError
from tasks.ids import rollout_id
from tasks.storage.ledger_files import decode_ledger_file
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.marker import ShardCounts, parse_shard_object, read_marker
from tasks.storage.objects import ObjectStore, sha256_hex
from tasks.storage.staging import CommitCoordinates

from ._writer_process import BATCH, make_call, make_chain, make_failure, make_receipt, run_attempt
from .markers import SHARD

A, B, C = rollout_id(0, 0), rollout_id(0, 1), rollout_id(1, 0)


class RecordingStore:
    """Forwards to a store and records the order of ``write_once`` paths."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.writes: list[str] = []

    def write_once(self, relative: str, data: bytes) -> Any:
        self.writes.append(relative)
        return self.inner.write_once(relative, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.sampled_from(("call", "failure", "receipt", "flush")), min_size=1, max_size=30),
    max_rows=st.integers(1, 4),
)
def test_receipt_file_is_written_only_after_earlier_calls_and_failures(ops: list[str], max_rows: int) -> None:
    inner = ObjectStore(f"memory://ledger-order-{uuid.uuid4().hex[:12]}")
    recording = RecordingStore(inner)
    writer = LedgerWriter(recording, batch_id=BATCH, shard=SHARD, attempt=0, max_rows=max_rows)  # type: ignore[arg-type]
    segment = layout.staging_segment(SHARD, 0, 0)
    added_before: dict[str, int] = {}
    added = 0
    for n, op in enumerate(ops):
        rollout = rollout_id(n, 0)
        if op == "call":
            (delta,) = make_chain(rollout, 1)
            writer.add_call(make_call(delta, CommitCoordinates(segment, n)))
            added += 1
        elif op == "failure":
            writer.add_failure(make_failure(rollout, f"{rollout}.a00.c000"))
            added += 1
        elif op == "receipt":
            writer.add_receipt(make_receipt(rollout, None, status="failed"))
            added_before[rollout] = added
        else:
            writer.flush()
    writer.flush()
    durable = 0
    for path in recording.writes:
        rows = len(_decode(inner, path))
        if "/receipts-" in path:
            for receipt in _decode(inner, path):
                assert added_before[receipt.rollout_id] <= durable
        else:
            durable += rows
    assert durable == added
    if recording.writes:
        inner.fs.rm(inner.root, recursive=True)


def _decode(store: ObjectStore, path: str) -> list[Any]:
    return decode_ledger_file(parse_shard_object(path, SHARD).kind, store.read_bytes(path), path=path)


def test_commit_writes_marker_last_naming_every_file_with_counts(batch: ObjectStore) -> None:
    recording = RecordingStore(batch)
    writer = LedgerWriter(recording, batch_id=BATCH, shard=SHARD, attempt=0, max_rows=2)  # type: ignore[arg-type]
    writer, segments = run_attempt(batch, SHARD, {A: 2, B: 1, C: 1}, attempt=0, receipted={A, B, C}, writer=writer)
    writer.add_failure(make_failure(C, "r000001-00.a00.c001"))
    marker = writer.commit(staging_segments=segments)
    assert recording.writes[-1] == layout.shard_marker(SHARD)
    assert read_marker(batch, SHARD) == marker
    named = {f.path for f in marker.files}
    assert named == {s.object.path for s in segments} | {f.path for f in writer.written_files}
    assert [f.path for f in marker.files_of("calls")] == [layout.ledger_file(SHARD, 0, "calls", i) for i in range(2)]
    for marked in marker.files:
        data = batch.read_bytes(marked.path)
        assert (len(data), sha256_hex(data)) == (marked.size, marked.sha256)
    assert marker.counts == ShardCounts(
        rollouts=3,
        ok=3,
        poisoned=0,
        failed=0,
        calls_recorded=4,
        calls_used=4,
        failures=1,
        staged_rows=4,
        adopted_rollouts=0,
    )
    assert writer.commit(staging_segments=segments) is marker
    with pytest.raises(RuntimeError, match="committed"):
        writer.add_receipt(make_receipt(rollout_id(9, 0), None, status="failed"))


def test_two_attempts_committing_one_shard_leave_exactly_one_marker(batch: ObjectStore) -> None:
    first, segments = run_attempt(batch, SHARD, {A: 1}, attempt=0, receipted={A})
    second, later = run_attempt(batch, SHARD, {A: 1}, attempt=1, receipted={A})
    marker = first.commit(staging_segments=segments)
    with pytest.raises(ObjectConflictError):
        second.commit(staging_segments=later)
    assert read_marker(batch, SHARD) == marker


def test_commit_refuses_a_call_outside_the_given_segments(mem_batch: ObjectStore) -> None:
    writer, _ = run_attempt(mem_batch, SHARD, {A: 1}, attempt=0, receipted={A})
    with pytest.raises(ValueError, match=r"call r000000-00\.a00\.c000 points at row 0 of staging/shard-00003"):
        writer.commit(staging_segments=[])
    assert read_marker(mem_batch, SHARD) is None


def test_same_call_twice_is_a_no_op_when_identical_and_a_conflict_otherwise(mem_batch: ObjectStore) -> None:
    writer = LedgerWriter(mem_batch, batch_id=BATCH, shard=SHARD, attempt=0)
    (delta,) = make_chain(A, 1)
    record = make_call(delta, CommitCoordinates(layout.staging_segment(SHARD, 0, 0), 0))
    writer.add_call(record)
    writer.add_call(make_call(delta, CommitCoordinates(layout.staging_segment(SHARD, 0, 0), 0)))
    with pytest.raises(LedgerConflictError) as raised:
        writer.add_call(make_call(delta, CommitCoordinates(layout.staging_segment(SHARD, 0, 0), 1)))
    assert raised.value.reason == "ledger_conflict"
    assert delta.call_id in str(raised.value)
    writer.flush()
    (calls_file,) = writer.written_files
    assert calls_file.rows == 1


def test_same_rollout_receipted_twice_is_a_no_op_when_identical_else_a_conflict(mem_batch: ObjectStore) -> None:
    writer = LedgerWriter(mem_batch, batch_id=BATCH, shard=SHARD, attempt=0)
    writer.add_receipt(make_receipt(A, None, status="failed"))
    writer.add_receipt(make_receipt(A, None, status="failed"))
    with pytest.raises(LedgerConflictError, match=f"rollout {A} already has a different receipt"):
        writer.add_receipt(make_receipt(A, None, status="poisoned"))


@pytest.mark.parametrize(
    ("segment", "fragment"),
    [
        (layout.staging_segment(SHARD + 1, 0, 0), "outside the staging and ledger directories of shard 3"),
        (layout.staging_segment(SHARD, 1, 0), "is not a staging segment of shard 3 attempt 0"),
        ("staging/elsewhere.parquet", "outside the staging and ledger directories"),
    ],
)
def test_call_pointing_outside_this_shard_attempt_staging_is_refused(
    mem_batch: ObjectStore, segment: str, fragment: str
) -> None:
    writer = LedgerWriter(mem_batch, batch_id=BATCH, shard=SHARD, attempt=0)
    (delta,) = make_chain(A, 1)
    with pytest.raises(ValueError, match=fragment):
        writer.add_call(make_call(delta, CommitCoordinates(segment, 0)))


def test_records_of_another_batch_and_receipts_of_another_attempt_are_refused(mem_batch: ObjectStore) -> None:
    writer = LedgerWriter(mem_batch, batch_id=BATCH, shard=SHARD, attempt=0)
    (delta,) = make_chain(A, 1, batch_id="other-batch")
    with pytest.raises(ValueError, match="belongs to batch other-batch"):
        writer.add_call(make_call(delta, CommitCoordinates(layout.staging_segment(SHARD, 0, 0), 0)))
    with pytest.raises(ValueError, match="belongs to batch other-batch"):
        writer.add_failure(make_failure(A, "c1", batch_id="other-batch"))
    with pytest.raises(ValueError, match="is for attempt 1, this writer is attempt 0"):
        writer.add_receipt(make_receipt(A, None, attempt=1, status="failed"))
