"""Token-free ledger writer, commit marker, trusted reader and recovery (ARCHITECTURE 4.3-4.5, 10)."""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tasks.capture import digest as dg
from tasks.capture.records import RECEIPT_STATUSES, TERMINAL_SELECTIONS, Receipt
from tasks.ids import rollout_id
from tasks.storage import layout
from tasks.storage.errors import (
    LedgerConflictError,
    MissingStagingRowError,
    SegmentChecksumMismatchError,
    UncommittedShardError,
)
from tasks.storage.ledger import (
    RECORD_OF_KIND,
    CorruptLedgerFileError,
    DuplicateReceiptError,
    LedgerReader,
    LedgerWriter,
    ShardAlreadyCommittedError,
    decode_ledger_file,
    encode_ledger_file,
    read_uncommitted_attempt,
    recover_earlier_attempts,
    rows_hold,
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
from tasks.storage.objects import ObjectConflictError, ObjectStore, sha256_hex
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import CommitCoordinates

from ._writer_process import BATCH, make_call, make_chain, make_failure, make_receipt, run_attempt

SHARD = 3
A, B, C = rollout_id(0, 0), rollout_id(0, 1), rollout_id(1, 0)


@pytest.fixture
def batch(store: ObjectStore) -> ObjectStore:
    """The batch directory on each backend: for behaviour that depends on the object store."""
    return store.child(layout.batch_dir(BATCH))


@pytest.fixture
def mem_batch() -> ObjectStore:
    """The batch directory on memory:// only: for logic that does not depend on the backend."""
    return ObjectStore(f"memory://ledger-{uuid.uuid4().hex[:12]}").child(layout.batch_dir(BATCH))


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


def _marker(files: tuple[MarkedFile, ...] = (), **overrides: Any) -> ShardMarker:
    rows = {kind: sum(f.rows for f in files if f.kind == kind) for kind in ("staging", "calls", "failures", "receipts")}
    counts = ShardCounts(
        rollouts=rows["receipts"],
        ok=rows["receipts"],
        poisoned=0,
        failed=0,
        calls=rows["calls"],
        failures=rows["failures"],
        staged_rows=rows["staging"],
        adopted_rollouts=sum(
            f.rows for f in files if f.kind == "receipts" and layout.attempt_of(f.path) < overrides.get("attempt", 0)
        ),
    )
    fields: dict[str, Any] = {
        "batch_id": BATCH,
        "shard": SHARD,
        "attempt": 0,
        "files": files,
        "counts": counts,
        "committed_at": 1.5,
    }
    return ShardMarker(**(fields | overrides))


def _file(kind: str, attempt: int = 0, index: int = 0, rows: int = 1) -> MarkedFile:
    path = (
        layout.staging_segment(SHARD, attempt, index)
        if kind == "staging"
        else layout.ledger_file(SHARD, attempt, kind, index)
    )
    return MarkedFile(path=path, kind=kind, size=10, sha256="ab" * 32, rows=rows)


# --- marker --------------------------------------------------------------------------------------


def test_marker_json_is_canonical_and_round_trips() -> None:
    marker = _marker((_file("receipts"), _file("calls", rows=2), _file("staging", rows=2)))
    text = marker.to_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert [f.kind for f in marker.files] == ["staging", "calls", "receipts"]
    assert ShardMarker.from_json(text) == marker


@settings(max_examples=50, deadline=None)
@given(
    attempt=st.integers(0, 120),
    files=st.lists(
        st.tuples(
            st.sampled_from(("staging", "calls", "failures", "receipts")),
            st.integers(0, 120),
            st.integers(0, 2_000_000),
            st.integers(0, 10_000),
        ),
        max_size=12,
        unique_by=lambda f: (f[0], f[1], f[2]),
    ),
)
def test_any_valid_marker_round_trips_in_ledger_order(attempt: int, files: list[tuple[str, int, int, int]]) -> None:
    marked = tuple(_file(kind, min(a, attempt), index, rows) for kind, a, index, rows in files)
    assume(len({f.path for f in marked}) == len(marked))
    marker = _marker(marked, attempt=attempt)
    parsed = ShardMarker.from_json(marker.to_json())
    assert parsed == marker
    calls = parsed.files_of("calls")
    keys = [(layout.attempt_of(f.path), f.path) for f in calls]
    assert [k[0] for k in keys] == sorted(k[0] for k in keys)


def _bad_marker_json(**changes: Any) -> str:
    raw = json.loads(_marker((_file("calls", rows=2), _file("staging", rows=2))).to_json())
    for key, value in changes.items():
        if value is None:
            del raw[key]
        else:
            raw[key] = value
    return json.dumps(raw)


def _bad_file(**changes: Any) -> str:
    raw = json.loads(_marker((_file("calls", rows=2),)).to_json())
    raw["files"][0] |= changes
    return json.dumps(raw)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        (_bad_marker_json(marker_version=2), "marker_version 2 is not supported"),
        (_bad_marker_json(marker_version=True), "marker_version True is not supported"),
        (_bad_marker_json(counts=None), "missing fields ['counts']"),
        (_bad_marker_json(extra=1), "unexpected fields ['extra']"),
        (_bad_marker_json(batch_id="../x"), "batch_id"),
        (_bad_marker_json(committed_at="yesterday"), "committed_at"),
        (_bad_marker_json(files={}), "files must be a list"),
        (_bad_file(path="ledger/shard-00004/attempt-00/calls-000000.parquet"), "outside the staging and ledger"),
        (_bad_file(path="ledger/shard-00003/attempt-00/calls-0.parquet"), "does not match the layout name"),
        (_bad_file(path="ledger/shard-00003/calls-000000.parquet"), "not inside an attempt directory"),
        (_bad_file(path="ledger/shard-00003/attempt-00/extra-000000.parquet"), "not a ledger file"),
        (_bad_file(path="ledger/shard-00003/attempt-01/calls-000000.parquet"), "after committing attempt 0"),
        (_bad_file(kind="receipts"), "is a calls object, marked as receipts"),
        (_bad_file(kind="tokens"), "kind must be one of"),
        (_bad_file(sha256="AB" * 32), "64 lowercase hex"),
        (_bad_file(size=-1), "size must be an int >= 0"),
        (_bad_file(rows=3), "counts.calls is 2, the named files hold 3 rows"),
        (_bad_file(owner="x"), "unexpected fields ['owner']"),
    ],
)
def test_malformed_marker_is_refused_with_named_problem(text: str, fragment: str) -> None:
    with pytest.raises(MalformedMarkerError) as raised:
        ShardMarker.from_json(text, source="m.json")
    assert raised.value.reason == "malformed_marker"
    assert fragment in str(raised.value)
    assert str(raised.value).startswith("m.json")


def test_marker_counts_must_agree_by_status_and_adoption() -> None:
    with pytest.raises(MalformedMarkerError, match=r"ok 1 \+ poisoned 1 \+ failed 0 != rollouts 1"):
        ShardCounts(rollouts=1, ok=1, poisoned=1, failed=0, calls=0, failures=0, staged_rows=0, adopted_rollouts=0)
    adopted_counts = ShardCounts(
        rollouts=1, ok=1, poisoned=0, failed=0, calls=0, failures=0, staged_rows=0, adopted_rollouts=0
    )
    with pytest.raises(MalformedMarkerError, match=r"counts\.adopted_rollouts is 0, the named files hold 1"):
        _marker((_file("receipts", attempt=0),), attempt=1, counts=adopted_counts)


def test_marker_naming_a_path_twice_is_refused() -> None:
    with pytest.raises(MalformedMarkerError, match="named twice"):
        _marker((_file("calls"), _file("calls")))


def test_write_marker_is_create_once(batch: ObjectStore) -> None:
    marker = _marker()
    assert write_marker(batch, marker).created
    assert not write_marker(batch, marker).created
    with pytest.raises(ObjectConflictError):
        write_marker(batch, _marker(committed_at=2.5))
    assert read_marker(batch, SHARD) == marker


def test_read_marker_is_none_for_uncommitted_shard_and_refuses_another_shards_marker(mem_batch: ObjectStore) -> None:
    assert read_marker(mem_batch, SHARD) is None
    mem_batch.write_once(layout.shard_marker(SHARD + 1), _marker().to_json().encode())
    with pytest.raises(MalformedMarkerError, match="marker of shard 3, not 4"):
        read_marker(mem_batch, SHARD + 1)


# --- writer --------------------------------------------------------------------------------------


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
            writer.add_call(make_call(delta, _coords(segment, n)))
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


def _coords(segment: str, row: int) -> CommitCoordinates:
    return CommitCoordinates(segment, row)


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
        rollouts=3, ok=3, poisoned=0, failed=0, calls=4, failures=1, staged_rows=4, adopted_rollouts=0
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
    record = make_call(delta, _coords(layout.staging_segment(SHARD, 0, 0), 0))
    writer.add_call(record)
    writer.add_call(make_call(delta, _coords(layout.staging_segment(SHARD, 0, 0), 0)))
    with pytest.raises(LedgerConflictError) as raised:
        writer.add_call(make_call(delta, _coords(layout.staging_segment(SHARD, 0, 0), 1)))
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
        writer.add_call(make_call(delta, _coords(segment, 0)))


def test_records_of_another_batch_and_receipts_of_another_attempt_are_refused(mem_batch: ObjectStore) -> None:
    writer = LedgerWriter(mem_batch, batch_id=BATCH, shard=SHARD, attempt=0)
    (delta,) = make_chain(A, 1, batch_id="other-batch")
    with pytest.raises(ValueError, match="belongs to batch other-batch"):
        writer.add_call(make_call(delta, _coords(layout.staging_segment(SHARD, 0, 0), 0)))
    with pytest.raises(ValueError, match="belongs to batch other-batch"):
        writer.add_failure(make_failure(A, "c1", batch_id="other-batch"))
    with pytest.raises(ValueError, match="is for attempt 1, this writer is attempt 0"):
        writer.add_receipt(make_receipt(A, None, attempt=1, status="failed"))


# --- reader --------------------------------------------------------------------------------------


def test_reader_refuses_a_shard_without_marker_even_when_ledger_files_exist(mem_batch: ObjectStore) -> None:
    writer, _ = run_attempt(mem_batch, SHARD, {A: 1}, attempt=0, receipted={A})
    writer.flush()
    with pytest.raises(UncommittedShardError) as raised:
        LedgerReader(mem_batch, SHARD)
    assert raised.value.reason == "uncommitted_shard"


def test_reader_trusts_only_the_files_the_marker_names(batch: ObjectStore) -> None:
    writer, segments = run_attempt(batch, SHARD, {A: 2}, attempt=0, receipted={A})
    writer.commit(staging_segments=segments)
    rogue = make_receipt(B, None, status="failed")
    batch.write_once(layout.ledger_file(SHARD, 0, "receipts", 1), encode_ledger_file(type(rogue), [rogue]))
    reader = LedgerReader(batch, SHARD)
    assert [r.rollout_id for r in reader.receipts] == [A]
    (bundle,) = reader.rollouts()
    assert [c.call_id for c in bundle.manifest] == [d.call_id for d in make_chain(A, 2)]
    assert reader.segment_sha256 == {s.object.path: s.object.sha256 for s in segments}
    staged = StagedReader(batch, segment_sha256=reader.segment_sha256).fetch_records(
        [(c.staging_key, _coords(c.staging_segment, c.staging_row)) for c in bundle.manifest]
    )
    assert [s.digest for s in staged] == [c.digest for c in bundle.manifest]


def test_reader_names_a_tampered_ledger_file(batch: ObjectStore) -> None:
    writer, segments = run_attempt(batch, SHARD, {A: 1}, attempt=0, receipted={A})
    marker = writer.commit(staging_segments=segments)
    (receipts,) = marker.files_of("receipts")
    tampered = make_receipt(A, None, status="poisoned")
    batch.delete(receipts.path)
    batch.write_once(receipts.path, encode_ledger_file(type(tampered), [tampered]))
    with pytest.raises(SegmentChecksumMismatchError) as raised:
        LedgerReader(batch, SHARD)
    assert raised.value.reason == "segment_checksum_mismatch"
    assert receipts.path in str(raised.value)
    batch.delete(receipts.path)
    with pytest.raises(SegmentChecksumMismatchError, match="named by the commit marker but missing"):
        LedgerReader(batch, SHARD)


def test_reader_names_a_committed_file_that_does_not_parse(mem_batch: ObjectStore) -> None:
    garbage = b"PAR1 definitely not parquet"
    path = layout.ledger_file(SHARD, 0, "calls", 0)
    mem_batch.write_once(path, garbage)
    marked = MarkedFile(path=path, kind="calls", size=len(garbage), sha256=sha256_hex(garbage), rows=0)
    write_marker(mem_batch, _marker((marked,)))
    with pytest.raises(CorruptLedgerFileError) as raised:
        LedgerReader(mem_batch, SHARD)
    assert raised.value.reason == "corrupt_ledger_file"
    assert path in str(raised.value)


def test_reader_refuses_a_file_of_the_wrong_record_schema(mem_batch: ObjectStore) -> None:
    receipt = make_receipt(A, None, status="failed")
    data = encode_ledger_file(type(receipt), [receipt])
    path = layout.ledger_file(SHARD, 0, "calls", 0)
    mem_batch.write_once(path, data)
    write_marker(mem_batch, _marker((MarkedFile(path, "calls", len(data), sha256_hex(data), 1),)))
    with pytest.raises(CorruptLedgerFileError, match="does not match the CallRecord schema"):
        LedgerReader(mem_batch, SHARD)


# --- recovery ------------------------------------------------------------------------------------


def test_manifests_take_calls_only_from_the_receipts_attempt(batch: ObjectStore) -> None:
    dead, _ = run_attempt(batch, SHARD, {A: 2, B: 1}, attempt=0, receipted={A})
    dead.flush()  # attempt 0 dies here: A is receipted, B is not
    recovery = recover_earlier_attempts(batch, SHARD, attempt=1)
    assert recovery.rollout_ids == {A}
    retry = LedgerWriter(batch, batch_id=BATCH, shard=SHARD, attempt=1, adopted=recovery)
    retry, segments = run_attempt(batch, SHARD, {B: 2}, attempt=1, receipted={B}, writer=retry)
    marker = retry.commit(staging_segments=segments)
    assert marker.counts.adopted_rollouts == 1
    assert marker.counts.rollouts == 2
    assert {f.path for f in recovery.files} <= {f.path for f in marker.files}
    bundles = {b.rollout_id: b for b in LedgerReader(batch, SHARD).rollouts()}
    assert [c.call_id for c in bundles[A].manifest] == [d.call_id for d in make_chain(A, 2, attempt=0)]
    assert [c.call_id for c in bundles[B].manifest] == [d.call_id for d in make_chain(B, 2, attempt=1)]


def test_adopted_rollout_cannot_be_receipted_again(mem_batch: ObjectStore) -> None:
    dead, _ = run_attempt(mem_batch, SHARD, {A: 1}, attempt=0, receipted={A})
    dead.flush()
    retry = LedgerWriter(
        mem_batch, batch_id=BATCH, shard=SHARD, attempt=1, adopted=recover_earlier_attempts(mem_batch, SHARD, attempt=1)
    )
    with pytest.raises(LedgerConflictError, match=f"rollout {A} was adopted"):
        retry.add_receipt(make_receipt(A, None, attempt=1, status="failed"))


def test_recovery_refuses_a_rollout_receipted_by_two_attempts(mem_batch: ObjectStore) -> None:
    for attempt in (0, 1):
        writer, _ = run_attempt(mem_batch, SHARD, {A: 1}, attempt=attempt, receipted={A})
        writer.flush()
    with pytest.raises(DuplicateReceiptError) as raised:
        recover_earlier_attempts(mem_batch, SHARD, attempt=2)
    assert raised.value.reason == "duplicate_receipt"
    assert A in str(raised.value)


def test_recovery_refuses_a_committed_shard(mem_batch: ObjectStore) -> None:
    writer, segments = run_attempt(mem_batch, SHARD, {A: 1}, attempt=0, receipted={A})
    writer.commit(staging_segments=segments)
    with pytest.raises(ShardAlreadyCommittedError):
        recover_earlier_attempts(mem_batch, SHARD, attempt=1)


def test_recovery_names_a_corrupt_ledger_file(mem_batch: ObjectStore) -> None:
    mem_batch.write_once(layout.ledger_file(SHARD, 0, "receipts", 0), b"\x00garbage")
    with pytest.raises(CorruptLedgerFileError, match=r"receipts-000000\.parquet cannot be read as receipts"):
        read_uncommitted_attempt(mem_batch, SHARD, 0)


def test_recovery_refuses_a_receipted_call_whose_segment_is_absent(mem_batch: ObjectStore) -> None:
    writer, segments = run_attempt(mem_batch, SHARD, {A: 1}, attempt=0, receipted={A})
    writer.flush()
    mem_batch.delete(segments[0].object.path)
    with pytest.raises(MissingStagingRowError, match="which is absent"):
        read_uncommitted_attempt(mem_batch, SHARD, 0)


def test_recovery_of_an_attempt_that_wrote_nothing_is_empty(mem_batch: ObjectStore) -> None:
    recovery = recover_earlier_attempts(mem_batch, SHARD, attempt=3)
    assert recovery.rollouts == ()
    assert recovery.files == ()


# --- column-wise proof of the record invariants ----------------------------------------------------

_HEX = "ab" * 32
_CHILD = {"parent_call_id": "r000000-00.a00.c000", "mode": "token_in", "prev_len": 3, "cum_len": 6}
_VALID_ROWS: dict[str, list[dict[str, Any]]] = {
    "calls": [
        {
            "batch_id": BATCH,
            "rollout_id": "r000000-00",
            "call_id": f"r000000-00.a00.c00{k}",
            "parent_call_id": None,
            "mode": "text",
            "prev_len": 0,
            "delta_len": 3,
            "cum_len": 3,
            "weight_version": 1,
            "epoch_span": False,
            "digest": _HEX,
            "extras_digest": _HEX,
            "chain_hash": _HEX,
            "cumulative_hash": _HEX,
            "staging_segment": "staging/shard-00003/attempt-00/seg-000000.parquet",
            "staging_row": k,
            "admitted_at": 1.0e9,
            "finish_reason": "stop",
            "output_fingerprint": None,
            "response_id": None,
        }
        | (_CHILD if k else {})
        for k in range(2)
    ],
    "failures": [
        {
            "batch_id": BATCH,
            "rollout_id": "r000000-00",
            "call_id": "r000000-00.a00.c002",
            "parent_call_id": None,
            "reason": "staging_failed",
            "detail": "",
        }
    ],
    "receipts": [
        {
            "rollout_id": "r000000-00",
            "group_id": "g000000",
            "attempt": 0,
            "reward": 1.0,
            "reward_info": "{}",
            "terminal_call_id": "r000000-00.a00.c001",
            "terminal_selection": "declared",
            "terminal_attribution_reason": "selected",
            "status": "ok",
            "failure_reason": None,
            "num_calls": 2,
        },
        {
            "rollout_id": "r000000-01",
            "group_id": "g000000",
            "attempt": 0,
            "reward": None,
            "reward_info": '{"a":[1,2]}',
            "terminal_call_id": None,
            "terminal_selection": None,
            "terminal_attribution_reason": None,
            "status": "failed",
            "failure_reason": "environment_error",
            "num_calls": 0,
        },
    ],
}
_TEXT = [
    "",
    "a",
    "A-b.c_9",
    "-x",
    "x/y",
    "é",
    "x" * 129,
    "0" * 64,
    "g" * 64,
    "AB" * 32,
    _HEX,
    "staging/x",
    *dg.MODES,
    *RECEIPT_STATUSES,
    *TERMINAL_SELECTIONS,
    "selected",
    "bad reason",
    "{}",
    "null",
    "NaN",
    '{"a":1}',
    '{"a": 1}',
]
_VALUES = {
    pa.string(): _TEXT,
    pa.int64(): [-1, 0, 1, 2, 7, 2**62, 2**63 - 1],
    pa.int32(): [-1, 0, 1],
    pa.uint64(): [0, 2**64 - 1],
    pa.float64(): [0.0, -1.5, math.nan, math.inf, -math.inf],
    pa.bool_(): [True, False],
}


@st.composite
def _edited_rows(draw: st.DrawFn, kind: str) -> list[dict[str, Any]]:
    """The valid rows of ``kind`` with one to three fields of one row set to edge values of their type."""
    rows = [dict(row) for row in _VALID_ROWS[kind]]
    row = draw(st.sampled_from(rows))
    for field in draw(st.lists(st.sampled_from(list(RECORD_OF_KIND[kind].arrow_schema())), min_size=1, max_size=3)):
        choices = [*_VALUES[field.type], *([None] if field.nullable else [])]
        row[field.name] = draw(st.sampled_from(choices))
    return rows


def _records_construct(kind: str, table: pa.Table) -> bool:
    try:
        RECORD_OF_KIND[kind].from_table(table)
    except (ValueError, TypeError):
        return False
    return True


@pytest.mark.parametrize("kind", sorted(_VALID_ROWS))
def test_valid_ledger_rows_are_proved_column_wise(kind: str) -> None:
    table = pa.Table.from_pylist(_VALID_ROWS[kind], schema=RECORD_OF_KIND[kind].arrow_schema())
    assert rows_hold(kind, table) and _records_construct(kind, table)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), kind=st.sampled_from(sorted(_VALID_ROWS)))
def test_the_column_wise_proof_never_accepts_a_row_its_record_refuses(data: st.DataObject, kind: str) -> None:
    table = pa.Table.from_pylist(data.draw(_edited_rows(kind)), schema=RECORD_OF_KIND[kind].arrow_schema())
    assert rows_hold(kind, table) == _records_construct(kind, table)


def test_reader_names_a_committed_ledger_row_that_breaks_its_record(mem_batch: ObjectStore) -> None:
    rows = [dict(row) for row in _VALID_ROWS["receipts"]]
    rows[1]["failure_reason"] = "Not A Reason"
    data = encode_table(pa.Table.from_pylist(rows, schema=Receipt.arrow_schema()))
    path = layout.ledger_file(SHARD, 0, "receipts", 0)
    mem_batch.write_once(path, data)
    write_marker(mem_batch, _marker((MarkedFile(path, "receipts", len(data), sha256_hex(data), 2),)))
    with pytest.raises(CorruptLedgerFileError, match=r"receipts-000000\.parquet cannot be read as receipts: "):
        LedgerReader(mem_batch, SHARD)


def encode_table(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()
