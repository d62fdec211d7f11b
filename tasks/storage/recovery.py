"""Recovery of a shard's uncommitted attempts (docs/architecture.md §10).

A retried generate task starts attempt k+1 of its shard. Each object an earlier attempt
wrote is complete or absent, and a receipt is written only after all of its rollout's call
records, so every receipt found is final: recovery hands each receipted rollout (ok or
poisoned), with its manifest, its failure rows and every object they live in, to the next
attempt to adopt. Re-running only the failures would bias the batch, so nothing receipted is
re-run. The call records of rollouts no attempt receipted are handed over too: a new attempt
replays them and goes on from the last (:mod:`tasks.generate.resume`). A committed shard has
nothing to recover.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks import layout
from tasks.errors import CorruptLedgerFileError, MissingStagingRowError, ShardAlreadyCommittedError
from tasks.ids import attempt_name
from tasks.records.ledger import CallRecord
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
class CommittedCall:
    """A call record of an earlier attempt whose rollout no attempt receipted: what a resume replays."""

    record: CallRecord
    attempt: int
    calls_file: MarkedFile  # the ledger file that holds the record


@dataclass(frozen=True)
class Recovery:
    """Rollouts that earlier, uncommitted attempts receipted, every object they need, and the calls of
    the rollouts none receipted.

    ``files`` names the receipts files, the calls and failures files that hold rows of these
    rollouts' manifests, and the staging segments their call records point at. ``unreceipted``
    holds, per rollout without a receipt, its call records in attempt order, then ledger order
    (:func:`carried_files` names the objects of those a new attempt replays).
    """

    rollouts: tuple[RolloutBundle, ...] = ()
    files: tuple[MarkedFile, ...] = ()
    unreceipted: Mapping[str, tuple[CommittedCall, ...]] = field(default_factory=dict)

    @property
    def rollout_ids(self) -> frozenset[str]:
        return frozenset(b.rollout_id for b in self.rollouts)


@dataclass(frozen=True)
class _AttemptLedger:
    """The ledger files of one uncommitted attempt, each with its rows as records."""

    attempt: int
    files: Mapping[str, list[tuple[MarkedFile, list[Any]]]]  # kind -> (file, records)

    def rows(self, kind: str) -> Iterator[tuple[MarkedFile, Any]]:
        return ((marked, row) for marked, rows in self.files[kind] for row in rows)


def read_uncommitted_attempt(store: ObjectStore, shard: int, attempt: int) -> Recovery:
    """The rollouts an uncommitted attempt receipted, and the objects that hold them; the calls it left of
    rollouts without a receipt.

    Lists ``ledger/shard-K/attempt-NN/``, ignoring names that are not ledger files (the
    attempt's claim, temp files of a crashed local write, compacted files: only a marker makes
    those valid), and the attempts before it for the calls its receipts replayed. Raises
    :class:`CorruptLedgerFileError` for a file that does not parse or whose rows contradict its
    location, :class:`DuplicateReceiptError`, and :class:`MissingStagingRowError` when a receipted
    call points at a segment that is absent.
    """
    ledgers = [_read_attempt(store, shard, earlier) for earlier in range(attempt + 1)]
    return _recovery(store, shard, ledgers, where=f"shard {shard} attempt {attempt}", of_attempt=attempt)


def recover_earlier_attempts(store: ObjectStore, shard: int, *, attempt: int) -> Recovery:
    """Everything attempts before ``attempt`` receipted, for attempt ``attempt`` to adopt, and the calls
    of the rollouts they did not receipt, for it to replay.

    Refuses a committed shard (:class:`ShardAlreadyCommittedError`) and a rollout receipted by
    two attempts (:class:`DuplicateReceiptError`).
    """
    if read_marker(store, shard) is not None:
        raise ShardAlreadyCommittedError(f"shard {shard} is already committed; nothing to recover")
    ledgers = [_read_attempt(store, shard, earlier) for earlier in range(attempt)]
    return _recovery(store, shard, ledgers, where=f"shard {shard} attempts before {attempt}")


def carried_files(store: ObjectStore, shard: int, calls: Iterable[CommittedCall]) -> list[MarkedFile]:
    """How a marker names the objects ``calls`` live in: their ledger files and staging segments, once each."""
    files: dict[str, MarkedFile] = {}
    for call in calls:
        files.setdefault(call.calls_file.path, call.calls_file)
        segment = call.record.staging_segment
        if segment not in files:
            files[segment] = _staging_segment(store, shard, call.attempt, segment, call.record.call_id)
    return list(files.values())


def _read_attempt(store: ObjectStore, shard: int, attempt: int) -> _AttemptLedger:
    """Every ledger file of ``attempt``, proved, with its records.

    Compacted files are skipped: they repeat rows of the attempt's other files, and only the
    attempt's own marker (absent here) makes them valid; an attempt that died after writing
    them is recovered from its small files alone, so no row is seen twice.
    """
    found: dict[str, list[tuple[int, str]]] = {kind: [] for kind in layout.LEDGER_KINDS}
    for path in store.list_files(f"{layout.ledger_shard_dir(shard)}/{attempt_name(attempt)}"):
        try:
            parsed = parse_shard_object(path, shard)
        except ValueError:
            continue
        if not parsed.compacted:
            found[parsed.kind].append((parsed.index, path))
    loaded = {kind: [_read_file(store, kind, path) for _, path in sorted(indexed)] for kind, indexed in found.items()}
    check_receipt_attempts((marked.path, table) for marked, table in loaded["receipts"])
    return _AttemptLedger(
        attempt=attempt,
        files={
            kind: [(marked, RECORD_OF_KIND[kind].from_checked_table(table)) for marked, table in files]
            for kind, files in loaded.items()
        },
    )


def _recovery(
    store: ObjectStore, shard: int, ledgers: Sequence[_AttemptLedger], *, where: str, of_attempt: int | None = None
) -> Recovery:
    """What ``ledgers`` (attempts in order) hold: receipted rollouts with their objects, and unreceipted calls;
    only those of attempt ``of_attempt`` when given (the others resolve its receipts' replayed calls)."""
    receipts = [receipt for ledger in ledgers for _, receipt in ledger.rows("receipts")]
    check_unique_receipts((r.rollout_id for r in receipts), where=where)
    if of_attempt is not None:
        receipts = [r for r in receipts if r.attempt == of_attempt]
        ledgers_of = [ledger for ledger in ledgers if ledger.attempt == of_attempt]
    else:
        ledgers_of = list(ledgers)
    calls = [(ledger.attempt, marked, call) for ledger in ledgers for marked, call in ledger.rows("calls")]
    failures = [(ledger.attempt, marked, row) for ledger in ledgers for marked, row in ledger.rows("failures")]
    bundles = bundle_rollouts(
        receipts,
        [call for _, _, call in calls],
        [row for _, _, row in failures],
        call_attempts=[attempt for attempt, _, _ in calls],
        failure_attempts=[attempt for attempt, _, _ in failures],
    )
    in_manifests = {id(call) for bundle in bundles for call in bundle.manifest}
    in_failures = {id(row) for bundle in bundles for row in bundle.failures}
    used = [CommittedCall(call, attempt, marked) for attempt, marked, call in calls if id(call) in in_manifests]
    files: dict[str, MarkedFile] = {m.path: m for ledger in ledgers_of for m, _ in ledger.files["receipts"]}
    files.update((m.path, m) for _, m, row in failures if id(row) in in_failures)
    files.update((m.path, m) for m in carried_files(store, shard, used))
    receipted = {b.rollout_id for b in bundles}
    unreceipted: dict[str, list[CommittedCall]] = {}
    for attempt, marked, call in calls:
        if call.rollout_id not in receipted and (of_attempt is None or attempt == of_attempt):
            unreceipted.setdefault(call.rollout_id, []).append(CommittedCall(call, attempt, marked))
    return Recovery(
        rollouts=tuple(bundles),
        files=tuple(sorted(files.values(), key=_marker_order)),
        unreceipted={rollout: tuple(found) for rollout, found in unreceipted.items()},
    )


def _marker_order(marked: MarkedFile) -> tuple[int, str]:
    """Receipts files, then calls, failures and staging segments, each by path."""
    return ("receipts", "calls", "failures", "staging").index(marked.kind), marked.path


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
