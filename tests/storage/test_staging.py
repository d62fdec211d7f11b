"""Group-commit staging writer and staged reader (docs/architecture.md §4.1, §5)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.errors import (
    CallIdMismatchError,
    DuplicateStagingKeyError,
    MissingStagingRowError,
    SegmentChecksumMismatchError,
    StagingKeyMismatchError,
    StorageIntegrityError,
)
from tasks.layout import staging_segment
from tasks.records.ledger import StagedDelta
from tasks.storage.objects import ObjectStore, WrittenObject, sha256_hex
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import CommitCoordinates, StagingWriter

NEVER_MS = 3_600_000.0  # a delay threshold that never fires within a test


def make_delta(rollout: str, call: str, *, carry: int = 3, generated: int = 2, seed: int = 0) -> StagedDelta:
    rng = np.random.default_rng(seed)
    return StagedDelta.build(
        batch_id="batch-1",
        rollout_id=rollout,
        call_id=call,
        parent_call_id=None,
        parent_chain_hash=None,
        prefix_token_ids=[],
        prompt_token_ids=rng.integers(0, 49152, carry),
        generated_token_ids=rng.integers(0, 49152, generated),
        generated_logprobs=-rng.exponential(0.5, generated).astype(np.float32),
        weight_version=1,
        finish_reason="stop",
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
    )


def key(delta: StagedDelta) -> str:
    return delta.staging_key


class BlockingWrites:
    """Fake store: ``write_once`` announces itself, then waits for ``release`` before writing."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.release = threading.Event()

    def write_once(self, relative: str, data: bytes) -> WrittenObject:
        self.started.set()
        assert self.release.wait(10), "test never released the write"
        return self.inner.write_once(relative, data)


class FailingFirstWrites:
    """Fake store: the first ``failures`` writes leave a partial temp object and raise."""

    def __init__(self, inner: ObjectStore, failures: int = 1) -> None:
        self.inner = inner
        self.failures = failures
        self.attempted: list[str] = []

    def write_once(self, relative: str, data: bytes) -> WrittenObject:
        self.attempted.append(relative)
        if len(self.attempted) <= self.failures:
            self.inner.write_once(relative + ".partial", data[: len(data) // 2])
            raise OSError(f"simulated failure writing {relative}")
        return self.inner.write_once(relative, data)


class CountingReads:
    """Spy store: counts ``read_bytes`` per object."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.reads: Counter[str] = Counter()

    def read_bytes(self, relative: str) -> bytes:
        self.reads[relative] += 1
        return self.inner.read_bytes(relative)


def stage(store, deltas: list[StagedDelta], **options) -> tuple[list[CommitCoordinates], StagingWriter]:
    options = {"max_delay_ms": NEVER_MS, **options}
    with StagingWriter(store, shard=0, attempt=0, **options) as writer:
        futures = [writer.submit(d) for d in deltas]
    return [f.result(timeout=10) for f in futures], writer


def deltas_of(count: int, *, prefix: str = "r") -> list[StagedDelta]:
    return [make_delta(f"{prefix}{i:03d}", f"{prefix}{i:03d}.a00.c000", carry=1 + i % 5, seed=i) for i in range(count)]


# --- writer -------------------------------------------------------------------------------


def test_coordinates_resolve_only_after_segment_object_exists(store: ObjectStore) -> None:
    blocking = BlockingWrites(store)
    with StagingWriter(blocking, shard=0, attempt=0, max_rows=1, max_delay_ms=NEVER_MS) as writer:
        future = writer.submit(make_delta("r1", "c1"))
        assert blocking.started.wait(10)
        time.sleep(0.05)
        assert not future.done()
        assert not store.exists(staging_segment(0, 0, 0))
        blocking.release.set()
        coords = future.result(timeout=10)
    assert coords == CommitCoordinates(staging_segment(0, 0, 0), 0)
    assert store.exists(coords.segment)


def test_row_threshold_triggers_flush(tmp_path) -> None:
    store = ObjectStore(str(tmp_path))
    with StagingWriter(store, shard=0, attempt=0, max_rows=3, max_delay_ms=NEVER_MS) as writer:
        futures = [writer.submit(d) for d in deltas_of(4)]
        rows = [f.result(timeout=10) for f in futures[:3]]
        time.sleep(0.1)
        assert not futures[3].done(), "a fourth row alone must wait for a threshold"
    assert rows == [CommitCoordinates(staging_segment(0, 0, 0), row) for row in range(3)]
    assert futures[3].result() == CommitCoordinates(staging_segment(0, 0, 1), 0)


def test_byte_threshold_triggers_flush(tmp_path) -> None:
    store = ObjectStore(str(tmp_path))
    with StagingWriter(store, shard=0, attempt=0, max_rows=1000, max_bytes=1, max_delay_ms=NEVER_MS) as writer:
        first = writer.submit(make_delta("r1", "c1")).result(timeout=10)
        second = writer.submit(make_delta("r2", "c1")).result(timeout=10)
    assert first == CommitCoordinates(staging_segment(0, 0, 0), 0)
    assert second == CommitCoordinates(staging_segment(0, 0, 1), 0)


def test_delay_threshold_triggers_flush(tmp_path) -> None:
    store = ObjectStore(str(tmp_path))
    with StagingWriter(store, shard=0, attempt=0, max_rows=1000, max_delay_ms=50) as writer:
        start = time.monotonic()
        coords = writer.submit(make_delta("r1", "c1")).result(timeout=10)
        elapsed = time.monotonic() - start
    assert coords.row == 0
    assert elapsed >= 0.045


def test_failed_flush_fails_every_future_of_it_and_later_submissions_succeed(tmp_path) -> None:
    store = ObjectStore(str(tmp_path))
    flaky = FailingFirstWrites(store)
    deltas = deltas_of(4)
    with StagingWriter(flaky, shard=0, attempt=0, max_rows=2, max_delay_ms=NEVER_MS) as writer:
        failed = [writer.submit(d) for d in deltas[:2]]
        for future in failed:
            with pytest.raises(OSError, match="simulated failure writing"):
                future.result(timeout=10)
        later = [f.result(timeout=10) for f in [writer.submit(d) for d in deltas[2:]]]
    assert later == [CommitCoordinates(staging_segment(0, 0, 1), row) for row in range(2)]
    assert [s.object.path for s in writer.segments] == [staging_segment(0, 0, 1)]
    records = StagedReader(store).fetch_records([(key(d), c) for d, c in zip(deltas[2:], later, strict=True)])
    assert records == deltas[2:]


def test_failed_segment_index_is_never_reused(tmp_path) -> None:
    flaky = FailingFirstWrites(ObjectStore(str(tmp_path)), failures=2)
    with StagingWriter(flaky, shard=0, attempt=0, max_rows=1, max_delay_ms=NEVER_MS) as writer:
        for delta in deltas_of(3):
            writer.submit(delta).exception(timeout=10)
    assert flaky.attempted == [staging_segment(0, 0, i) for i in range(3)]


def test_duplicate_key_submitted_twice_fails_the_second_future(tmp_path) -> None:
    delta = make_delta("r1", "c1")
    with StagingWriter(ObjectStore(str(tmp_path)), shard=0, attempt=0, max_delay_ms=0) as writer:
        first = writer.submit(delta)
        second = writer.submit(delta)
        assert first.result(timeout=10).row == 0
        with pytest.raises(DuplicateStagingKeyError, match="r1/c1") as info:
            second.result(timeout=10)
    assert info.value.reason == "duplicate_staging_key"


def test_submit_after_close_raises_and_close_is_idempotent(tmp_path) -> None:
    writer = StagingWriter(ObjectStore(str(tmp_path)), shard=0, attempt=0)
    future = writer.submit(make_delta("r1", "c1"))
    writer.close()
    writer.close()
    assert future.result(timeout=0).row == 0, "close flushes what is buffered"
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(make_delta("r2", "c1"))


def test_flush_writes_what_is_buffered_and_waits(tmp_path) -> None:
    with StagingWriter(ObjectStore(str(tmp_path)), shard=0, attempt=0, max_delay_ms=NEVER_MS) as writer:
        futures = [writer.submit(d) for d in deltas_of(3)]
        writer.flush()
        assert all(f.done() for f in futures)


def test_segments_list_path_size_sha256_and_rows(store: ObjectStore) -> None:
    _, writer = stage(store, deltas_of(5), max_rows=3)
    assert [(s.object.path, s.rows) for s in writer.segments] == [
        (staging_segment(0, 0, 0), 3),
        (staging_segment(0, 0, 1), 2),
    ]
    for segment in writer.segments:
        data = store.read_bytes(segment.object.path)
        assert (segment.object.size, segment.object.sha256) == (len(data), sha256_hex(data))


def test_many_threads_submitting_concurrently_get_distinct_coordinates(tmp_path) -> None:
    store = ObjectStore(str(tmp_path))
    deltas = deltas_of(200)
    with StagingWriter(store, shard=0, attempt=0, max_rows=16, max_delay_ms=5) as writer:
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = list(pool.map(writer.submit, deltas))
        coords = [f.result(timeout=20) for f in futures]
    assert len(set(coords)) == len(deltas)
    assert sum(s.rows for s in writer.segments) == len(deltas)
    assert StagedReader(store).fetch_records([(key(d), c) for d, c in zip(deltas, coords, strict=True)]) == deltas


# --- reader -------------------------------------------------------------------------------


def test_round_trip_in_arbitrary_requested_order(store: ObjectStore) -> None:
    deltas = deltas_of(7)
    coords, writer = stage(store, deltas, max_rows=3)
    order = [5, 0, 6, 2, 4, 1, 3]
    marker = {s.object.path: s.object.sha256 for s in writer.segments}
    reader = StagedReader(store, segment_sha256=marker)
    requests = [(key(deltas[i]), coords[i]) for i in order]
    assert reader.fetch_records(requests) == [deltas[i] for i in order]
    table = reader.fetch(requests)
    assert table.schema == StagedDelta.arrow_schema()
    token_ids = reader.fetch_token_ids(requests)
    for i, ids in zip(order, token_ids, strict=True):
        assert ids.dtype == np.int64
        np.testing.assert_array_equal(ids, deltas[i].token_ids_delta)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6)), min_size=1, max_size=12),
    max_rows=st.integers(1, 5),
    data=st.data(),
)
def test_round_trip_property(sizes: list[tuple[int, int]], max_rows: int, data: st.DataObject) -> None:
    store = ObjectStore(f"memory://staging-prop-{uuid.uuid4().hex[:12]}")
    deltas = [
        make_delta(f"r{i}", f"r{i}.a00.c000", carry=carry, generated=generated, seed=i)
        for i, (carry, generated) in enumerate(sizes)
        if carry + generated > 0
    ]
    coords, _ = stage(store, deltas, max_rows=max_rows)
    order = data.draw(st.permutations(range(len(deltas))))
    subset = order[: data.draw(st.integers(1, len(order)))]
    fetched = StagedReader(store).fetch_records([(key(deltas[i]), coords[i]) for i in subset])
    assert fetched == [deltas[i] for i in subset]


def test_fetch_reads_each_segment_once(store: ObjectStore) -> None:
    deltas = deltas_of(10)
    coords, _ = stage(store, deltas, max_rows=5)
    spy = CountingReads(store)
    reader = StagedReader(spy, cached_segments=0)
    requests = [(key(d), c) for d, c in zip(deltas, coords, strict=True)][::-1]
    assert len(reader.fetch(requests)) == 10
    assert spy.reads == {staging_segment(0, 0, 0): 1, staging_segment(0, 0, 1): 1}


def test_cached_segments_are_not_read_again_across_fetches(tmp_path) -> None:
    store = ObjectStore(str(tmp_path))
    deltas = deltas_of(4)
    coords, _ = stage(store, deltas)
    spy = CountingReads(store)
    reader = StagedReader(spy)
    for delta, coord in zip(deltas, coords, strict=True):
        reader.fetch_token_ids([(key(delta), coord)])
    assert spy.reads == {staging_segment(0, 0, 0): 1}


@pytest.fixture
def staged(store: ObjectStore) -> tuple[ObjectStore, list[StagedDelta], list[CommitCoordinates], dict[str, str]]:
    deltas = [make_delta("r1", "r1.a00.c000"), make_delta("r2", "r2.a00.c000"), make_delta("r2", "r2.a00.c001")]
    coords, writer = stage(store, deltas)
    return store, deltas, coords, {s.object.path: s.object.sha256 for s in writer.segments}


def test_row_past_segment_is_missing_staging_row(staged) -> None:
    store, deltas, coords, _ = staged
    past = CommitCoordinates(coords[0].segment, 3)
    with pytest.raises(MissingStagingRowError, match=r"r1/r1\.a00\.c000: row 3 is past the 3 rows of segment") as info:
        StagedReader(store).fetch([(key(deltas[0]), past)])
    assert info.value.reason == "missing_staging_row"


def test_missing_segment_object_is_missing_staging_row(staged) -> None:
    store, deltas, _, _ = staged
    absent = CommitCoordinates(staging_segment(0, 0, 9), 0)
    with pytest.raises(MissingStagingRowError, match=r"seg-000009\.parquet does not exist") as info:
        StagedReader(store).fetch([(key(deltas[0]), absent)])
    assert info.value.reason == "missing_staging_row"


def test_segment_not_named_by_marker_is_missing_staging_row(staged) -> None:
    store, deltas, coords, _ = staged
    with pytest.raises(MissingStagingRowError, match="not named by the commit marker") as info:
        StagedReader(store, segment_sha256={}).fetch([(key(deltas[0]), coords[0])])
    assert info.value.reason == "missing_staging_row"


def test_segment_with_other_bytes_than_marker_is_checksum_mismatch(staged) -> None:
    store, deltas, coords, marker = staged
    wrong = {path: "0" * 64 for path in marker}
    with pytest.raises(SegmentChecksumMismatchError, match=r"seg-000000\.parquet has sha256") as info:
        StagedReader(store, segment_sha256=wrong).fetch([(key(deltas[0]), coords[0])])
    assert info.value.reason == "segment_checksum_mismatch"


def test_same_key_requested_twice_is_duplicate_staging_key(staged) -> None:
    store, deltas, coords, _ = staged
    with pytest.raises(DuplicateStagingKeyError, match=r"r1/r1\.a00\.c000 is requested twice") as info:
        StagedReader(store).fetch([(key(deltas[0]), coords[0]), (key(deltas[0]), coords[1])])
    assert info.value.reason == "duplicate_staging_key"


def test_row_of_another_rollout_is_staging_key_mismatch(staged) -> None:
    store, deltas, coords, _ = staged
    with pytest.raises(StagingKeyMismatchError, match=r"r1/r1\.a00\.c000: row 1 of segment .* holds r2/") as info:
        StagedReader(store).fetch([(key(deltas[0]), coords[1])])
    assert info.value.reason == "staging_key_mismatch"


def test_row_of_another_call_of_same_rollout_is_call_id_mismatch(staged) -> None:
    store, deltas, coords, _ = staged
    with pytest.raises(CallIdMismatchError, match=r"r2/r2\.a00\.c000: row 2 of segment .* holds r2/r2\.a00\.c001"):
        StagedReader(store).fetch([(key(deltas[1]), coords[2])])


def test_segment_with_foreign_schema_is_invalid_staged_row(tmp_path) -> None:
    store = ObjectStore(str(tmp_path))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"rollout_id": ["r1"], "call_id": ["c1"]}), sink)
    path = staging_segment(0, 0, 0)
    store.write_once(path, sink.getvalue().to_pybytes())
    with pytest.raises(StorageIntegrityError, match="missing columns") as info:
        StagedReader(store).fetch([("r1/c1", CommitCoordinates(path, 0))])
    assert info.value.reason == "invalid_staged_row"


def test_empty_request_returns_empty_table(tmp_path) -> None:
    table = StagedReader(ObjectStore(str(tmp_path))).fetch([])
    assert table.num_rows == 0
    assert table.schema == StagedDelta.arrow_schema()
