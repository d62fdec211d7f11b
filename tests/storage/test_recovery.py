"""Recovery of uncommitted attempts: receipted rollouts adopted with their objects (docs/architecture.md §10)."""

from __future__ import annotations

import pytest

from tasks import layout
from tasks.errors import (
    CorruptLedgerFileError,
    DuplicateReceiptError,
    LedgerConflictError,
    MissingStagingRowError,
    ShardAlreadyCommittedError,
)
from tasks.ids import rollout_id
from tasks.storage.claims import claim_attempt
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.objects import ObjectStore
from tasks.storage.recovery import read_uncommitted_attempt, recover_earlier_attempts

from ._writer_process import BATCH, make_chain, make_receipt, run_attempt
from .markers import SHARD

A, B = rollout_id(0, 0), rollout_id(0, 1)


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


def test_recovery_reads_past_the_attempts_claim(mem_batch: ObjectStore) -> None:
    claim = claim_attempt(mem_batch, batch_id=BATCH, shard=SHARD)
    writer, _ = run_attempt(mem_batch, SHARD, {A: 1}, attempt=claim.attempt, receipted={A})
    writer.flush()
    recovery = read_uncommitted_attempt(mem_batch, SHARD, claim.attempt)
    assert recovery.rollout_ids == {A}
    assert claim.path not in {f.path for f in recovery.files}
