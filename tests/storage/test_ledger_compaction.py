"""Compaction at commit: an attempt's own small ledger files rewritten into files of ``max_rows`` rows.

The marker names the compacted files instead of the small ones (which the sweep then deletes),
the committed ledger reads the same rows in the same order as without compaction, files of
earlier attempts are named byte for byte as they were, recovery never reads a compacted file,
and a commit that failed part-way is retried with the same files and marker
(tasks/storage/ledger_writer.py; docs/architecture.md §4, §10).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks import layout
from tasks.ids import rollout_id
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.marker import MarkedFile, ShardMarker, parse_shard_object, read_marker
from tasks.storage.objects import ObjectStore, WrittenObject, sha256_hex
from tasks.storage.recovery import carried_files, read_uncommitted_attempt, recover_earlier_attempts
from tasks.storage.staging import CommitCoordinates, WrittenSegment
from tasks.storage.sweep import sweep_orphans

from ._writer_process import BATCH, make_call, make_chain, make_failure, make_receipt, stage
from .markers import SHARD

A, B, C, R = rollout_id(0, 0), rollout_id(0, 1), rollout_id(1, 0), rollout_id(2, 0)


def run_flushed(
    store: ObjectStore,
    writer: LedgerWriter,
    chains: dict[str, int],
    *,
    receipted: set[str],
    failed: frozenset[str] = frozenset(),
) -> list[WrittenSegment]:
    """Stage ``chains`` (rollout -> calls), then record them as the ``on_committed`` hook makes them durable:
    a flush after every call record, failure row and receipt. A rollout in ``failed`` gets a failure row
    after its calls; one in ``receipted`` its receipt after that."""
    attempt = writer.attempt
    deltas = {r: make_chain(r, n, attempt=attempt) for r, n in chains.items()}
    flat = [d for chain in deltas.values() for d in chain]
    coords, segments = stage(store, flat, shard=SHARD, attempt=attempt)
    for delta, where in zip(flat, coords, strict=True):
        writer.add_call(make_call(delta, where))
        writer.flush()
        chain = deltas[delta.rollout_id]
        if delta is not chain[-1]:
            continue
        if delta.rollout_id in failed:
            writer.add_failure(make_failure(delta.rollout_id, f"{delta.rollout_id}.a{attempt:02d}.c999"))
            writer.flush()
        if delta.rollout_id in receipted:
            writer.add_receipt(make_receipt(delta.rollout_id, delta.call_id, attempt=attempt))
            writer.flush()
    return segments


def shard_objects(store: ObjectStore) -> dict[str, str]:
    """Path -> sha256 of every object under the shard's staging and ledger folders."""
    return {
        path: sha256_hex(store.read_bytes(path))
        for folder in (layout.staging_shard_dir(SHARD), layout.ledger_shard_dir(SHARD))
        for path in store.list_files(folder)
    }


def own_ledger_files(marker: ShardMarker, kind: str) -> list[MarkedFile]:
    return [f for f in marker.files_of(kind) if layout.attempt_of(f.path) == marker.attempt]


def is_compacted(path: str) -> bool:
    return parse_shard_object(path, SHARD).compacted


def test_compacted_marker_names_only_compacted_own_files_and_earlier_files_unchanged(batch: ObjectStore) -> None:
    """Attempt 0 dies with A receipted and R half done; attempt 1 adopts A, resumes R (replaying its calls)."""
    dead = LedgerWriter(batch, batch_id=BATCH, shard=SHARD, attempt=0)
    run_flushed(batch, dead, {A: 2, R: 2}, receipted={A})
    first_attempt = shard_objects(batch)
    recovery = recover_earlier_attempts(batch, SHARD, attempt=1)
    replayed = recovery.unreceipted[R]
    carried = carried_files(batch, SHARD, replayed)

    retry = LedgerWriter(batch, batch_id=BATCH, shard=SHARD, attempt=1, adopted=recovery, max_rows=3)
    segments = run_flushed(batch, retry, {B: 2, C: 3, R: 1}, receipted={B, C}, failed=frozenset({C}))
    (own_call,) = make_chain(R, 1, attempt=1)
    resumed = make_receipt(R, own_call.call_id, attempt=1)
    retry.add_receipt(dataclasses.replace(resumed, replayed_calls=tuple(c.record.call_id for c in replayed)))
    retry.flush()
    small = {f.path for f in retry.written_files}
    marker = retry.commit(staging_segments=segments, carried=carried)

    # Own rows: 6 calls in 6 small files -> 3 + 3; 3 receipts in 3 -> 1; the one failures file stays as it is.
    assert [(f.path, f.rows) for f in own_ledger_files(marker, "calls")] == [
        (layout.ledger_file(SHARD, 1, "calls", 0, compacted=True), 3),
        (layout.ledger_file(SHARD, 1, "calls", 1, compacted=True), 3),
    ]
    assert [(f.path, f.rows) for f in own_ledger_files(marker, "receipts")] == [
        (layout.ledger_file(SHARD, 1, "receipts", 0, compacted=True), 3)
    ]
    assert [f.path for f in own_ledger_files(marker, "failures")] == [layout.ledger_file(SHARD, 1, "failures", 0)]
    named = {f.path for f in marker.files}
    assert named & small == {layout.ledger_file(SHARD, 1, "failures", 0)}
    # Earlier attempts' files: exactly what was adopted and carried, byte for byte as attempt 0 left them.
    earlier = {f.path: f for f in marker.files if layout.attempt_of(f.path) == 0}
    assert set(earlier) == {f.path for f in (*recovery.files, *carried)}
    assert not any(is_compacted(path) for path in earlier)
    for path, marked in earlier.items():
        assert marked.sha256 == first_attempt[path] == sha256_hex(batch.read_bytes(path)), path

    reader = LedgerReader(batch, SHARD)
    bundles = {b.rollout_id: b for b in reader.rollouts()}
    assert {r: b.receipt.attempt for r, b in bundles.items()} == {A: 0, B: 1, C: 1, R: 1}
    assert [c.call_id for c in bundles[R].manifest] == [
        *(c.record.call_id for c in replayed),
        own_call.call_id,
    ]
    assert [c.call_id for c in bundles[C].manifest] == [d.call_id for d in make_chain(C, 3, attempt=1)]
    assert [f.call_id for f in bundles[C].failures] == [f"{C}.a01.c999"]
    assert marker.counts.adopted_rollouts == 1 and marker.counts.rollouts == 4
    assert retry.commit(staging_segments=segments, carried=carried) is marker


def test_sweep_after_a_compacted_commit_deletes_the_small_files_and_the_ledger_reads_the_same(
    batch: ObjectStore,
) -> None:
    writer = LedgerWriter(batch, batch_id=BATCH, shard=SHARD, attempt=0, max_rows=4)
    segments = run_flushed(batch, writer, {A: 3, B: 2, C: 2}, receipted={A, B, C}, failed=frozenset({A, B}))
    small = [f.path for f in writer.written_files]
    marker = writer.commit(staging_segments=segments)
    compacted = [f.path for f in writer.written_files if is_compacted(f.path)]
    assert [parse_shard_object(p, SHARD).kind for p in compacted] == ["calls", "calls", "failures", "receipts"]
    assert {f.path for f in marker.files if f.kind != "staging"} == set(compacted)
    before = LedgerReader(batch, SHARD).tables

    report = sweep_orphans(batch, SHARD)
    assert sorted(report.deleted) == sorted(small)
    assert not any(batch.exists(path) for path in small)
    assert all(batch.exists(path) for path in compacted)
    after = LedgerReader(batch, SHARD).tables
    assert after.calls.equals(before.calls) and after.receipts.equals(before.receipts)
    assert after.failures.equals(before.failures)
    assert [b.rollout_id for b in LedgerReader(batch, SHARD).rollouts()] == [A, B, C]


class MarkerWriteFails:
    """Forwards to a store, but the shard marker's write raises before writing: the attempt dies there."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner

    def write_once(self, relative: str, data: bytes) -> WrittenObject:
        if relative == layout.shard_marker(SHARD):
            raise ConnectionError(f"lost the node before writing {relative}")
        return self.inner.write_once(relative, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_attempt_dead_after_compaction_before_its_marker_is_recovered_from_its_small_files_once(
    batch: ObjectStore,
) -> None:
    dying = LedgerWriter(MarkerWriteFails(batch), batch_id=BATCH, shard=SHARD, attempt=0, max_rows=2)  # type: ignore[arg-type]
    segments = run_flushed(batch, dying, {A: 2, B: 3, C: 1}, receipted={A, B}, failed=frozenset({B}))
    with pytest.raises(ConnectionError):
        dying.commit(staging_segments=segments)
    left = batch.list_files(f"{layout.ledger_shard_dir(SHARD)}/attempt-00")
    compacted = [p for p in left if is_compacted(p)]
    assert {parse_shard_object(p, SHARD).kind for p in compacted} == {"calls", "receipts"}  # a duplicate of each row
    assert read_marker(batch, SHARD) is None

    recovery = recover_earlier_attempts(batch, SHARD, attempt=1)  # a receipt seen twice would raise here
    assert [b.rollout_id for b in recovery.rollouts] == [A, B]
    assert [len(b.manifest) for b in recovery.rollouts] == [2, 3]
    assert [len(b.failures) for b in recovery.rollouts] == [0, 1]
    assert [c.record.call_id for c in recovery.unreceipted[C]] == [f"{C}.a00.c000"]
    assert not any(is_compacted(f.path) for f in recovery.files)
    assert read_uncommitted_attempt(batch, SHARD, 0).rollout_ids == {A, B}

    retry = LedgerWriter(batch, batch_id=BATCH, shard=SHARD, attempt=1, adopted=recovery, max_rows=2)
    later = run_flushed(batch, retry, {C: 2}, receipted={C})
    marker = retry.commit(staging_segments=later)
    reader = LedgerReader(batch, SHARD)
    assert reader.tables.receipts.column("rollout_id").to_pylist() == [A, B, C]
    assert {r: b.receipt.attempt for r, b in ((b.rollout_id, b) for b in reader.rollouts())} == {A: 0, B: 0, C: 1}
    call_ids = reader.tables.calls.column("call_id").to_pylist()
    assert len(call_ids) == len(set(call_ids)) == 2 + 3 + 2
    assert f"{C}.a00.c000" not in call_ids  # its own small file, named by nobody
    assert marker.counts.adopted_rollouts == 2
    assert set(compacted) <= set(sweep_orphans(batch, SHARD).deleted)


class FailsOnce:
    """Forwards to a store; the first write of ``path`` raises, after writing (``lands``) or before."""

    def __init__(self, inner: ObjectStore, path: str, *, lands: bool) -> None:
        self.inner = inner
        self.path = path
        self.lands = lands
        self.failed = False
        self.writes: list[tuple[str, str]] = []  # (path, sha256) of every write tried

    def write_once(self, relative: str, data: bytes) -> WrittenObject:
        self.writes.append((relative, sha256_hex(data)))
        if relative == self.path and not self.failed:
            self.failed = True
            if self.lands:
                self.inner.write_once(relative, data)
            raise TimeoutError(f"no answer writing {relative}")
        return self.inner.write_once(relative, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("lands", [True, False], ids=["landed", "lost"])
@pytest.mark.parametrize(
    "failing",
    [
        layout.ledger_file(SHARD, 0, "calls", 1, compacted=True),
        layout.ledger_file(SHARD, 0, "receipts", 0, compacted=True),
        layout.shard_marker(SHARD),
    ],
    ids=["calls", "receipts", "marker"],
)
def test_a_commit_that_failed_part_way_is_retried_with_the_same_files_and_marker(
    mem_batch: ObjectStore, failing: str, lands: bool
) -> None:
    store = FailsOnce(mem_batch, failing, lands=lands)
    writer = LedgerWriter(store, batch_id=BATCH, shard=SHARD, attempt=0, max_rows=2)  # type: ignore[arg-type]
    segments = run_flushed(mem_batch, writer, {A: 2, B: 1, C: 1}, receipted={A, B, C})
    with pytest.raises(TimeoutError):
        writer.commit(staging_segments=segments)
    with pytest.raises(RuntimeError, match="committing or committed"):
        writer.add_receipt(make_receipt(R, None, status="failed"))
    marker = writer.commit(staging_segments=segments)
    assert read_marker(mem_batch, SHARD) == marker
    tried: dict[str, set[str]] = {}
    for path, sha in store.writes:
        tried.setdefault(path, set()).add(sha)
    assert all(len(shas) == 1 for shas in tried.values()), tried  # every retry: the same bytes
    assert store.writes.count((failing, next(iter(tried[failing])))) == 2
    assert writer.commit(staging_segments=segments) is marker
    assert [b.rollout_id for b in LedgerReader(mem_batch, SHARD).rollouts()] == [A, B, C]


def test_no_compaction_when_the_files_are_already_as_few_as_max_rows_allows_or_when_off(
    mem_batch: ObjectStore,
) -> None:
    full = LedgerWriter(mem_batch, batch_id=BATCH, shard=SHARD, attempt=0, max_rows=2)
    deltas = [*make_chain(A, 2), *make_chain(B, 2)]
    coords, segments = stage(mem_batch, deltas, shard=SHARD, attempt=0)
    for delta, where in zip(deltas, coords, strict=True):
        full.add_call(make_call(delta, where))  # written two at a time, as max_rows fills up
    marker = full.commit(staging_segments=segments)
    assert [f.rows for f in marker.files_of("calls")] == [2, 2]
    assert not any(is_compacted(f.path) for f in full.written_files)

    other = ObjectStore(f"memory://ledger-{uuid.uuid4().hex[:12]}").child(layout.batch_dir(BATCH))
    off = LedgerWriter(other, batch_id=BATCH, shard=SHARD, attempt=0, max_rows=8, compact=False)
    later = run_flushed(other, off, {A: 3}, receipted={A})
    assert [f.rows for f in off.commit(staging_segments=later).files_of("calls")] == [1, 1, 1]
    assert not any(is_compacted(f.path) for f in off.written_files)


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.sampled_from(("call", "failure", "receipt", "flush", "flush")), min_size=1, max_size=30),
    max_rows=st.integers(1, 4),
)
def test_compacted_ledger_reads_the_rows_of_the_uncompacted_one_in_the_same_order(
    ops: list[str], max_rows: int
) -> None:
    readers, markers = [], []
    for compact in (True, False):
        store = ObjectStore(f"memory://compaction-{uuid.uuid4().hex[:12]}").child(layout.batch_dir(BATCH))
        writer = LedgerWriter(store, batch_id=BATCH, shard=SHARD, attempt=0, max_rows=max_rows, compact=compact)
        segment = layout.staging_segment(SHARD, 0, 0)
        for n, op in enumerate(ops):
            rollout = rollout_id(n, 0)
            if op == "call":
                (delta,) = make_chain(rollout, 1)
                writer.add_call(make_call(delta, CommitCoordinates(segment, n)))
            elif op == "failure":
                writer.add_failure(make_failure(rollout, f"{rollout}.a00.c000"))
            elif op == "receipt":
                writer.add_receipt(make_receipt(rollout, None, status="failed"))
            else:
                writer.flush()
        staged = WrittenSegment(store.write_once(segment, b"rows not read here"), rows=len(ops))
        markers.append(writer.commit(staging_segments=[staged]))
        readers.append(LedgerReader(store, SHARD))
        store.fs.rm(store.root, recursive=True)
    compacted, plain = readers
    for kind in ("calls", "failures", "receipts"):
        assert getattr(compacted.tables, kind).equals(getattr(plain.tables, kind)), kind
        files = markers[0].files_of(kind)
        rows = sum(f.rows for f in files)
        if any(is_compacted(f.path) for f in files):  # then all of them, max_rows a file
            assert all(is_compacted(f.path) for f in files)
            assert [f.rows for f in files] == [max_rows] * (rows // max_rows) + (
                [rows % max_rows] if rows % max_rows else []
            )
            assert len(markers[1].files_of(kind)) > len(files)
        else:
            assert markers[0].files_of(kind) == markers[1].files_of(kind)
    assert markers[0].counts == markers[1].counts
    assert (compacted.tables.call_attempts == plain.tables.call_attempts).all()
    assert compacted.tables.receipts.num_rows == ops.count("receipt")
