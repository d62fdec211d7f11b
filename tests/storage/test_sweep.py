"""Orphan sweep of a committed shard (docs/architecture.md §10)."""

from __future__ import annotations

import os
import time

import pytest

from tasks import layout
from tasks.errors import UncommittedShardError
from tasks.ids import rollout_id
from tasks.storage.claims import claim_attempt, read_claims
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.objects import ObjectStore
from tasks.storage.recovery import recover_earlier_attempts
from tasks.storage.sweep import TEMP_GRACE_SECONDS, sweep_orphans

from ._writer_process import BATCH, run_attempt

SHARD = 0
A, B = rollout_id(0, 0), rollout_id(0, 1)


def _shard_objects(batch: ObjectStore, shard: int = SHARD) -> list[str]:
    return batch.list_files(layout.staging_shard_dir(shard)) + batch.list_files(layout.ledger_shard_dir(shard))


def test_sweep_deletes_a_dead_attempts_objects_and_keeps_every_named_one(batch: ObjectStore) -> None:
    dead, _ = run_attempt(batch, SHARD, {A: 2, B: 1}, attempt=0, receipted=set())
    dead.flush()
    orphans = _shard_objects(batch)
    writer, segments = run_attempt(batch, SHARD, {A: 1, B: 1}, attempt=1, receipted={A, B})
    marker = writer.commit(staging_segments=segments)
    neighbour, _ = run_attempt(batch, SHARD + 1, {A: 1}, attempt=0, receipted=set())
    neighbour.flush()
    before_neighbour = _shard_objects(batch, SHARD + 1)

    preview = sweep_orphans(batch, SHARD, dry_run=True)
    assert preview.orphans == tuple(sorted(orphans))
    assert preview.deleted == ()
    assert set(preview.kept) == {f.path for f in marker.files} | {marker.path}
    assert set(_shard_objects(batch)) == set(preview.orphans) | set(preview.kept)

    report = sweep_orphans(batch, SHARD)
    assert report.deleted == preview.orphans
    assert sorted(_shard_objects(batch)) == sorted(preview.kept)
    assert _shard_objects(batch, SHARD + 1) == before_neighbour
    assert [b.rollout_id for b in LedgerReader(batch, SHARD).rollouts()] == [A, B]
    assert sweep_orphans(batch, SHARD).orphans == ()


def test_sweep_keeps_files_adopted_from_an_earlier_attempt(batch: ObjectStore) -> None:
    dead, _ = run_attempt(batch, SHARD, {A: 1, B: 1}, attempt=0, receipted={A})
    dead.flush()
    recovery = recover_earlier_attempts(batch, SHARD, attempt=1)
    retry = LedgerWriter(batch, batch_id=BATCH, shard=SHARD, attempt=1, adopted=recovery)
    retry, segments = run_attempt(batch, SHARD, {B: 1}, attempt=1, receipted={B}, writer=retry)
    retry.commit(staging_segments=segments)
    report = sweep_orphans(batch, SHARD)
    assert {f.path for f in recovery.files} <= set(report.kept)
    assert all(layout.attempt_of(p) == 0 for p in report.deleted)
    assert {b.rollout_id: b.receipt.attempt for b in LedgerReader(batch, SHARD).rollouts()} == {A: 0, B: 1}


def test_sweep_keeps_every_attempts_claim(batch: ObjectStore) -> None:
    dead_claim = claim_attempt(batch, batch_id=BATCH, shard=SHARD, try_number=1)
    dead, _ = run_attempt(batch, SHARD, {A: 1}, attempt=dead_claim.attempt, receipted=set())
    dead.flush()
    claim = claim_attempt(batch, batch_id=BATCH, shard=SHARD, try_number=2)
    writer, segments = run_attempt(batch, SHARD, {A: 1}, attempt=claim.attempt, receipted={A})
    marker = writer.commit(staging_segments=segments)
    stray = f"{layout.ledger_shard_dir(SHARD)}/{layout.CLAIM_NAME}"  # not where the layout puts a claim
    batch.write_once(stray, b"{}")
    assert {f.path for f in marker.files}.isdisjoint({dead_claim.path, claim.path})

    report = sweep_orphans(batch, SHARD)
    assert {dead_claim.path, claim.path} <= set(report.kept)
    assert not {dead_claim.path, claim.path} & set(report.orphans)
    assert stray in report.deleted
    assert [c.attempt for c in read_claims(batch, SHARD)] == [0, 1]
    assert sweep_orphans(batch, SHARD).orphans == ()


def test_sweep_deletes_old_temp_files_of_crashed_local_writes_and_spares_a_live_writers(tmp_path) -> None:
    batch = ObjectStore(str(tmp_path / "root")).child(layout.batch_dir(BATCH))
    writer, segments = run_attempt(batch, SHARD, {A: 1}, attempt=0, receipted={A})
    writer.commit(staging_segments=segments)
    leftovers = [
        f"{layout.staging_shard_dir(SHARD)}/attempt-00/.tmp-k3j2.part",
        f"{layout.ledger_shard_dir(SHARD)}/.tmp-x9y8.part",
    ]
    old = time.time() - TEMP_GRACE_SECONDS - 60
    for path in leftovers:
        (tmp_path / "root" / layout.batch_dir(BATCH) / path).write_bytes(b"half a segm")
        os.utime(tmp_path / "root" / layout.batch_dir(BATCH) / path, (old, old))
    live = f"{layout.ledger_shard_dir(SHARD)}/.tmp-live.part"  # another attempt's marker, mid-write
    (tmp_path / "root" / layout.batch_dir(BATCH) / live).write_bytes(b"{")
    assert sweep_orphans(batch, SHARD).deleted == tuple(sorted(leftovers))
    assert not any(batch.exists(p) for p in leftovers)
    assert batch.exists(live)


def test_sweep_refuses_an_uncommitted_shard_and_deletes_nothing(batch: ObjectStore) -> None:
    writer, _ = run_attempt(batch, SHARD, {A: 1}, attempt=0, receipted={A})
    writer.flush()
    present = _shard_objects(batch)
    with pytest.raises(UncommittedShardError) as raised:
        sweep_orphans(batch, SHARD, dry_run=True)
    assert raised.value.reason == "uncommitted_shard"
    with pytest.raises(UncommittedShardError):
        sweep_orphans(batch, SHARD)
    assert _shard_objects(batch) == present
