"""The trusted reader: only what the marker names, each file's bytes and rows checked (architecture.md §2, §4.3-4.5)."""

from __future__ import annotations

import pytest

from tasks import layout
from tasks.errors import CorruptLedgerFileError, SegmentChecksumMismatchError, UncommittedShardError
from tasks.ids import rollout_id
from tasks.records.ledger import Receipt
from tasks.storage.ledger_files import encode_ledger_file
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.marker import MarkedFile, write_marker
from tasks.storage.objects import ObjectStore, sha256_hex
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import CommitCoordinates

from ._writer_process import make_chain, make_receipt, run_attempt
from .markers import SHARD, marker_of

A, B = rollout_id(0, 0), rollout_id(0, 1)


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
        [(c.staging_key, CommitCoordinates(c.staging_segment, c.staging_row)) for c in bundle.manifest]
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
    write_marker(mem_batch, marker_of((marked,)))
    with pytest.raises(CorruptLedgerFileError) as raised:
        LedgerReader(mem_batch, SHARD)
    assert raised.value.reason == "corrupt_ledger_file"
    assert path in str(raised.value)


def test_reader_refuses_a_file_of_the_wrong_record_schema(mem_batch: ObjectStore) -> None:
    receipt = make_receipt(A, None, status="failed")
    data = encode_ledger_file(type(receipt), [receipt])
    path = layout.ledger_file(SHARD, 0, "calls", 0)
    mem_batch.write_once(path, data)
    write_marker(mem_batch, marker_of((MarkedFile(path, "calls", len(data), sha256_hex(data), 1),)))
    with pytest.raises(CorruptLedgerFileError, match="does not match the CallRecord schema"):
        LedgerReader(mem_batch, SHARD)


def test_reader_names_a_committed_ledger_row_that_breaks_its_record(mem_batch: ObjectStore) -> None:
    broken = Receipt.trusted(make_receipt(B, None, status="failed").to_row() | {"failure_reason": "Not A Reason"})
    data = encode_ledger_file(Receipt, [make_receipt(A, None, status="failed"), broken])
    path = layout.ledger_file(SHARD, 0, "receipts", 0)
    mem_batch.write_once(path, data)
    write_marker(mem_batch, marker_of((MarkedFile(path, "receipts", len(data), sha256_hex(data), 2),)))
    with pytest.raises(
        CorruptLedgerFileError, match=r"receipts-000000\.parquet cannot be read as receipts: .*Not A Reason"
    ):
        LedgerReader(mem_batch, SHARD)
