"""A writer process killed with SIGKILL at chosen and at random points (docs/architecture.md §10).

Crash anywhere: no ledger row points at missing data, no committed or receipted rollout is
lost or duplicated, no partial object is trusted, and the sweep removes what no marker names.
The store is local disk or S3 (moto): memory:// is private to a process.
"""

from __future__ import annotations

import random
import time

import pytest

from tasks import layout
from tasks.errors import UncommittedShardError
from tasks.ids import rollout_id
from tasks.storage.ledger_files import RolloutBundle
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.marker import parse_shard_object, read_marker
from tasks.storage.objects import ObjectStore
from tasks.storage.recovery import recover_earlier_attempts
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import CommitCoordinates
from tasks.storage.sweep import sweep_orphans

from ._writer_process import BATCH, WriterProcess, run_attempt

SHARD = 2
A, B, C = rollout_id(0, 0), rollout_id(0, 1), rollout_id(0, 2)


@pytest.fixture(params=["local", "s3"])
def batch(request: pytest.FixtureRequest, tmp_path) -> ObjectStore:
    """A batch directory that a child process can open by URL."""
    if request.param == "local":
        root = ObjectStore(str(tmp_path / "root"))
    else:
        root = ObjectStore(f"{request.getfixturevalue('s3_bucket')}/root", skip_instance_cache=True)
    return root.child(layout.batch_dir(BATCH))


def _assert_staged_rows_match(batch: ObjectStore, bundles: list[RolloutBundle], sha256: dict[str, str] | None) -> None:
    """Every manifest row resolves to a staged row whose digest recomputes to the recorded one."""
    reader = StagedReader(batch, segment_sha256=sha256)
    for bundle in bundles:
        staged = reader.fetch_records(
            [(c.staging_key, CommitCoordinates(c.staging_segment, c.staging_row)) for c in bundle.manifest]
        )
        assert [s.recompute_digest() for s in staged] == [c.digest for c in bundle.manifest]


def _commit_retry(batch: ObjectStore, rerun: dict[str, int]) -> LedgerReader:
    """Attempt 1: adopt what attempt 0 receipted, re-run ``rerun``, commit; the committed reader."""
    recovery = recover_earlier_attempts(batch, SHARD, attempt=1)
    retry = LedgerWriter(batch, batch_id=BATCH, shard=SHARD, attempt=1, adopted=recovery)
    retry, segments = run_attempt(batch, SHARD, rerun, attempt=1, receipted=set(rerun), writer=retry)
    retry.commit(staging_segments=segments)
    return LedgerReader(batch, SHARD)


def test_kill_after_staging_leaves_an_orphan_segment_that_no_marker_names(batch: ObjectStore) -> None:
    with WriterProcess("stage-then-hang", batch.url, str(SHARD), "0") as writer:
        said = writer.next()
        writer.kill()
    orphans = sorted(said["segments"])
    assert set(said["staged"]) <= set(orphans)
    assert all(batch.exists(path) for path in orphans)
    assert batch.list_files(layout.ledger_shard_dir(SHARD)) == []
    assert read_marker(batch, SHARD) is None
    with pytest.raises(UncommittedShardError):
        LedgerReader(batch, SHARD)
    with pytest.raises(UncommittedShardError):
        sweep_orphans(batch, SHARD)

    reader = _commit_retry(batch, {A: 2, B: 2})
    assert not set(orphans) & {f.path for f in reader.marker.files}
    bundles = list(reader.rollouts())
    assert [(b.rollout_id, b.receipt.attempt, len(b.manifest)) for b in bundles] == [(A, 1, 2), (B, 1, 2)]
    _assert_staged_rows_match(batch, bundles, reader.segment_sha256)

    preview = sweep_orphans(batch, SHARD, dry_run=True)
    assert list(preview.orphans) == orphans
    assert all(batch.exists(path) for path in orphans)
    assert list(sweep_orphans(batch, SHARD).deleted) == orphans
    assert not any(batch.exists(path) for path in orphans)
    assert [b.rollout_id for b in LedgerReader(batch, SHARD).rollouts()] == [A, B]


def test_kill_between_calls_file_and_receipt_does_not_adopt_the_unreceipted_rollout(batch: ObjectStore) -> None:
    with WriterProcess("ledger-then-hang", batch.url, str(SHARD), "0") as writer:
        assert writer.next() == {"receipted": A}
        said = writer.next()
        writer.kill()
    assert said["unreceipted"] == B
    late_calls = layout.ledger_file(SHARD, 0, "calls", 1)
    assert late_calls in said["files"]
    assert not batch.exists(layout.ledger_file(SHARD, 0, "receipts", 1))

    recovery = recover_earlier_attempts(batch, SHARD, attempt=1)
    assert recovery.rollout_ids == {A}
    assert {f.path for f in recovery.files} == {
        layout.ledger_file(SHARD, 0, "receipts", 0),
        layout.ledger_file(SHARD, 0, "calls", 0),
        layout.staging_segment(SHARD, 0, 0),
    }

    reader = _commit_retry(batch, {B: 2})
    bundles = {b.rollout_id: b for b in reader.rollouts()}
    assert {r: b.receipt.attempt for r, b in bundles.items()} == {A: 0, B: 1}
    assert all(".a00." in c.call_id for c in bundles[A].manifest)
    assert [c.call_id for c in bundles[B].manifest] == ["r000000-01.a01.c000", "r000000-01.a01.c001"]
    assert any(c.rollout_id == B for c in reader.calls if ".a00." in c.call_id)  # the leftovers are there, unused
    _assert_staged_rows_match(batch, list(bundles.values()), reader.segment_sha256)
    assert set(sweep_orphans(batch, SHARD).deleted) == {late_calls, layout.staging_segment(SHARD, 0, 1)}


def test_kill_after_compaction_before_the_marker_recovers_each_rollout_once_from_the_small_files(
    batch: ObjectStore,
) -> None:
    with WriterProcess("compact-then-hang", batch.url, str(SHARD), "0") as writer:
        written = writer.next()["written"]
        writer.kill()
    compacted = [p for p in written if parse_shard_object(p, SHARD).compacted]
    assert {parse_shard_object(p, SHARD).kind for p in compacted} == {"calls", "receipts"}
    assert all(batch.exists(p) for p in compacted) and read_marker(batch, SHARD) is None

    recovery = recover_earlier_attempts(batch, SHARD, attempt=1)
    assert [(b.rollout_id, len(b.manifest)) for b in recovery.rollouts] == [(A, 2), (B, 2)]
    assert not {f.path for f in recovery.files} & set(compacted)
    assert len(recovery.unreceipted[C]) == 2

    reader = _commit_retry(batch, {C: 2})
    assert reader.tables.receipts.column("rollout_id").to_pylist() == [A, B, C]
    assert {b.rollout_id: b.receipt.attempt for b in reader.rollouts()} == {A: 0, B: 0, C: 1}
    _assert_staged_rows_match(batch, list(reader.rollouts()), reader.segment_sha256)
    assert set(compacted) <= set(sweep_orphans(batch, SHARD).deleted)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_kill_at_a_random_point_loses_no_receipted_rollout(batch: ObjectStore, seed: int) -> None:
    with WriterProcess("loop", batch.url, str(SHARD), "0") as writer:
        durable_through = writer.next()["durable_through"]
        time.sleep(random.Random(seed).uniform(0.0, 0.4))
        writer.kill()
    durable_through = max([durable_through, *(line["durable_through"] for line in writer.drain())])

    recovery = recover_earlier_attempts(batch, SHARD, attempt=1)
    adopted = sorted(recovery.rollout_ids)
    assert adopted[: durable_through + 1] == [rollout_id(t, 0) for t in range(durable_through + 1)]
    assert adopted == [rollout_id(t, 0) for t in range(len(adopted))]
    assert all(len(b.manifest) == 2 for b in recovery.rollouts)
    _assert_staged_rows_match(batch, list(recovery.rollouts), None)

    rerun = rollout_id(999_999, 9)
    reader = _commit_retry(batch, {rerun: 1})
    committed = [b.rollout_id for b in reader.rollouts()]
    assert sorted(committed) == sorted([*adopted, rerun])
    _assert_staged_rows_match(batch, list(reader.rollouts()), reader.segment_sha256)
    report = sweep_orphans(batch, SHARD)
    assert all(layout.attempt_of(path) == 0 for path in report.deleted)
    assert sorted(b.rollout_id for b in LedgerReader(batch, SHARD).rollouts()) == sorted(committed)
