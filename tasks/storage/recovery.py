"""Recovery of a shard's uncommitted attempts (docs/architecture.md §10).

A retried generate task starts attempt k+1 of its shard. Each object an earlier attempt
wrote is complete or absent, and a receipt is written only after all of its rollout's call
records, so every receipt found is final: recovery hands each receipted rollout (ok or
poisoned), with its manifest, its failure rows and every object they live in, to the next
attempt to adopt. Re-running only the failures would bias the batch, so nothing receipted is
re-run. A committed shard has nothing to recover.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from tasks import layout
from tasks.errors import CorruptLedgerFileError, MissingStagingRowError, ShardAlreadyCommittedError
from tasks.ids import attempt_name
from tasks.storage.ledger_files import (
    RECORD_OF_KIND,
    RolloutBundle,
    bundle_rollouts,
    check_receipt_attempts,
    check_unique_receipts,
    decode_ledger_table,
)
from tasks.storage.marker import MarkedFile, parse_shard_object, read_marker
from tasks.storage.objects import ObjectStore, sha256_hex


@dataclass(frozen=True)
class Recovery:
    """Rollouts that earlier, uncommitted attempts receipted, and every object they need.

    ``files`` names the receipts files, the calls and failures files that hold rows of these
    rollouts, and the staging segments their call records point at.
    """

    rollouts: tuple[RolloutBundle, ...] = ()
    files: tuple[MarkedFile, ...] = ()

    @property
    def rollout_ids(self) -> frozenset[str]:
        return frozenset(b.rollout_id for b in self.rollouts)


def read_uncommitted_attempt(store: ObjectStore, shard: int, attempt: int) -> Recovery:
    """The receipted rollouts an uncommitted attempt wrote, and the objects that hold them.

    Lists ``ledger/shard-K/attempt-NN/``, ignoring names that are not ledger files (the
    attempt's claim, temp files of a crashed local write). Raises :class:`CorruptLedgerFileError`
    for a file that does not parse or whose rows contradict its location,
    :class:`DuplicateReceiptError`, and :class:`MissingStagingRowError` when a receipted call
    points at a segment that is absent.
    """
    found: dict[str, list[tuple[int, str]]] = {kind: [] for kind in layout.LEDGER_KINDS}
    for path in store.list_files(f"{layout.ledger_shard_dir(shard)}/{attempt_name(attempt)}"):
        try:
            parsed = parse_shard_object(path, shard)
        except ValueError:
            continue
        found[parsed.kind].append((parsed.index, path))
    loaded = {kind: [_read_file(store, kind, path) for _, path in sorted(indexed)] for kind, indexed in found.items()}
    check_receipt_attempts((marked.path, table) for marked, table in loaded["receipts"])
    records = {
        kind: [(marked, RECORD_OF_KIND[kind].from_checked_table(table)) for marked, table in files]
        for kind, files in loaded.items()
    }
    receipts, calls, failures = (
        [r for _, rows in records[kind] for r in rows] for kind in ("receipts", "calls", "failures")
    )
    check_unique_receipts((r.rollout_id for r in receipts), where=f"shard {shard} attempt {attempt}")
    bundles = bundle_rollouts(
        receipts,
        calls,
        failures,
        call_attempts=[attempt] * len(calls),
        failure_attempts=[attempt] * len(failures),
    )
    receipted = {b.rollout_id for b in bundles}
    files = [marked for marked, _ in loaded["receipts"]]
    for kind in ("calls", "failures"):
        files.extend(marked for marked, rows in records[kind] if any(r.rollout_id in receipted for r in rows))
    segments = sorted({call.staging_segment: call for b in bundles for call in b.manifest}.items())
    files.extend(_staging_segment(store, shard, attempt, path, call.call_id) for path, call in segments)
    return Recovery(rollouts=tuple(bundles), files=tuple(files))


def recover_earlier_attempts(store: ObjectStore, shard: int, *, attempt: int) -> Recovery:
    """Everything attempts before ``attempt`` receipted, for attempt ``attempt`` to adopt.

    Refuses a committed shard (:class:`ShardAlreadyCommittedError`) and a rollout receipted by
    two attempts (:class:`DuplicateReceiptError`).
    """
    if read_marker(store, shard) is not None:
        raise ShardAlreadyCommittedError(f"shard {shard} is already committed; nothing to recover")
    parts = [read_uncommitted_attempt(store, shard, earlier) for earlier in range(attempt)]
    rollouts = tuple(b for part in parts for b in part.rollouts)
    check_unique_receipts((b.rollout_id for b in rollouts), where=f"shard {shard} attempts before {attempt}")
    return Recovery(rollouts=rollouts, files=tuple(f for part in parts for f in part.files))


def _read_file(store: ObjectStore, kind: str, path: str) -> tuple[MarkedFile, pa.Table]:
    """A ledger file of an uncommitted attempt, every row proved, and how a marker would name it."""
    data = store.read_bytes(path)
    table = decode_ledger_table(kind, data, path=path)
    return MarkedFile(path=path, kind=kind, size=len(data), sha256=sha256_hex(data), rows=table.num_rows), table


def _staging_segment(store: ObjectStore, shard: int, attempt: int, path: str, call_id: str) -> MarkedFile:
    """How a marker would name the segment ``path`` that a receipted call of ``attempt`` points at."""
    try:
        parsed = parse_shard_object(path, shard)
    except ValueError:
        parsed = None
    if parsed is None or parsed.kind != "staging" or parsed.attempt != attempt:
        raise CorruptLedgerFileError(f"call {call_id} of attempt {attempt} points at foreign segment {path}")
    try:
        data = store.read_bytes(path)
    except FileNotFoundError:
        raise MissingStagingRowError(f"call {call_id} points at segment {path}, which is absent") from None
    rows = pq.read_metadata(pa.BufferReader(data)).num_rows
    return MarkedFile(path=path, kind="staging", size=len(data), sha256=sha256_hex(data), rows=rows)
