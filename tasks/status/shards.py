"""One planned shard's state, read from its marker, ledger files, claims and attempt objects.

Never raises for what storage holds: a marker, committed file or claim that cannot be trusted
makes the shard ``unreadable`` with the error. In progress versus abandoned is inferred from
storage times: a live writer that writes nothing for longer than the activity window looks
abandoned.

A failover (engine ``vllm_server`` lost one of its replicas, and the shard went on in a new
attempt on the others: docs/servers.md) is read from the claims: an attempt whose next attempt
the same process (host and pid) claimed failed over, since a generate process claims a shard
again only then. Where a committed shard's calls ran and what resuming its rollouts did
(:mod:`tasks.capture.replay`) are read from the notes of its receipts' reward info, which is
storage content: a note not of the shape the capture writes counts nothing. The calls its rollouts
use are counted from the named ledger files (:attr:`~tasks.storage.ledger_reader.LedgerReader.calls_used`):
a version-1 marker does not record them, and a version-2 marker's figure is checked.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from tasks import layout
from tasks.batch import Batch
from tasks.errors import MalformedClaimError, StorageIntegrityError, UncommittedShardError
from tasks.records.ledger import COULD_NOT_REPLAY, FAILED_OVER_NOTE, RESUMED_COUNTS, RESUMED_NOTE, SERVED_BY_NOTE
from tasks.status.model import AttemptStatus, CommittedShard, ResumeCounts, ShardStatus
from tasks.storage.claims import AttemptClaim, read_claims
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.marker import SHARD_FILE_KINDS, parse_shard_object
from tasks.storage.objects import ObjectStore


def shard_status(batch: Batch, shard: int, active_since: float) -> ShardStatus:
    """The state of ``shard``; an uncommitted attempt active at or after ``active_since`` is in progress."""
    store = batch.store
    try:
        ledger = batch.ledger(shard)
    except UncommittedShardError:
        try:
            return _uncommitted_status(store, shard, active_since)
        except MalformedClaimError as exc:
            return ShardStatus(shard=shard, state="unreadable", error=f"{type(exc).__name__}: {exc}")
    except (StorageIntegrityError, ValueError, OSError) as exc:
        return ShardStatus(shard=shard, state="unreadable", error=f"{type(exc).__name__}: {exc}")
    try:
        failovers = failed_over(read_claims(store, shard))
        committed = _committed_shard(ledger, failovers)
    except (MalformedClaimError, StorageIntegrityError) as exc:
        return ShardStatus(shard=shard, state="unreadable", error=f"{type(exc).__name__}: {exc}")
    return ShardStatus(shard=shard, state="committed", committed=committed)


def failed_over(claims: Iterable[AttemptClaim]) -> tuple[int, ...]:
    """The attempts whose next attempt the same process (host, pid) claimed: each failed over."""
    ordered = sorted(claims, key=lambda claim: claim.attempt)
    return tuple(a.attempt for a, b in itertools.pairwise(ordered) if (a.host, a.pid) == (b.host, b.pid))


def _committed_shard(ledger: LedgerReader, failovers: tuple[int, ...]) -> CommittedShard:
    tables = ledger.tables
    receipts = tables.receipts
    poisoned = receipts.filter(pc.equal(receipts.column("status"), "poisoned"))
    versions = pc.min_max(tables.calls.column("weight_version")).as_py()
    notes = receipt_notes(receipts.column("reward_info").to_pylist())
    return CommittedShard(
        attempt=ledger.marker.attempt,
        committed_at=ledger.marker.committed_at,
        counts=ledger.marker.counts,
        calls=ledger.calls_used,  # the marker's figure checked, or computed for a version-1 marker
        failures_by_reason=_value_counts(tables.failures.column("reason")),
        poisoned_by_reason=_value_counts(poisoned.column("failure_reason")),
        weight_version_min=versions["min"],
        weight_version_max=versions["max"],
        failovers=failovers,
        calls_by_server=notes.calls_by_server,
        rollouts_failed_over=notes.rollouts_failed_over,
        resumed=notes.resumed,
    )


class ReceiptNotes(NamedTuple):
    """What a shard's receipts note in their reward info (:func:`tasks.generate.receipts.capture_notes`)."""

    calls_by_server: dict[str, int]  # summed over the ``served_by`` notes, by URL
    rollouts_failed_over: int  # receipts with a ``failed_over`` note
    resumed: ResumeCounts  # the ``resumed`` notes summed (:func:`_resume_counts`)


def receipt_notes(reward_infos: Iterable[str]) -> ReceiptNotes:
    """The notes of receipts' reward info (JSON text), summed.

    The reward info is storage content: a receipt whose note is not of the shape the capture writes
    counts nothing for that note.
    """
    calls: Counter[str] = Counter()
    failed_over = 0
    resumed = ResumeCounts()
    for text in reward_infos:
        try:
            info = json.loads(text)
        except (TypeError, ValueError):
            continue
        if not isinstance(info, dict):
            continue
        served = info.get(SERVED_BY_NOTE)
        if isinstance(served, dict) and all(isinstance(n, int) and n >= 0 for n in served.values()):
            calls.update({str(url): n for url, n in served.items()})
        failed_over += bool(info.get(FAILED_OVER_NOTE))
        resumed += _resume_counts(info.get(RESUMED_NOTE))
    return ReceiptNotes(dict(sorted(calls.items())), failed_over, resumed)


def _resume_counts(note: object) -> ResumeCounts:
    """One receipt's ``resumed`` note as counts (one rollout resumed); nothing for an absent or malformed note.

    Well formed: an object whose ``episode``, ``replayed``, ``live`` and ``diverged`` are integers at
    least 0 and whose ``could_not_replay``, when present, is a list of strings.
    """
    if not isinstance(note, dict):
        return ResumeCounts()
    counts = [note.get(key) for key in RESUMED_COUNTS]
    refused = note.get(COULD_NOT_REPLAY, [])
    if not all(type(n) is int and n >= 0 for n in counts):
        return ResumeCounts()
    if not (isinstance(refused, list) and all(isinstance(reason, str) for reason in refused)):
        return ResumeCounts()
    _, replayed, live, diverged = counts
    return ResumeCounts(
        rollouts=1, replayed_calls=replayed, live_calls=live, divergences=diverged, replays_refused=len(refused)
    )


def _value_counts(column: pa.ChunkedArray) -> dict[str, int]:
    """Occurrences of each value, by value (nulls left out)."""
    counted = pc.value_counts(column.drop_null()).to_pylist()
    return {entry["values"]: entry["counts"] for entry in sorted(counted, key=lambda e: e["values"])}


def _uncommitted_status(store: ObjectStore, shard: int, active_since: float) -> ShardStatus:
    """An uncommitted shard's attempts (a claim that does not parse raises: the shard is then unreadable)."""
    objects = _attempt_objects(store, shard)
    if not objects:
        return ShardStatus(shard=shard, state="not_started")
    claims = {claim.attempt: claim for claim in read_claims(store, shard)}
    failovers = failed_over(claims.values())
    attempts = tuple(
        AttemptStatus(
            attempt=attempt,
            claim=claims.get(attempt),
            objects={kind: sum(kind == k for k, _ in found) for kind in SHARD_FILE_KINDS},
            last_activity=_last_activity(store, claims.get(attempt), found),
            failed_over=attempt in failovers,
        )
        for attempt, found in sorted(objects.items())
    )
    active = any(a.last_activity is not None and a.last_activity >= active_since for a in attempts)
    return ShardStatus(shard=shard, state="in_progress" if active else "abandoned", attempts=attempts)


def _attempt_objects(store: ObjectStore, shard: int) -> dict[int, list[tuple[str, str]]]:
    """attempt -> (kind, path) of each object it left under the shard's staging and ledger directories.

    Kinds are the marker's file kinds and the claim's name; other names (temp files of a crashed
    local write) count as ``other``. Objects outside attempt directories (the marker) are skipped.
    """
    found: dict[int, list[tuple[str, str]]] = {}
    for directory in (layout.staging_shard_dir(shard), layout.ledger_shard_dir(shard)):
        for path in store.list_files(directory):
            try:
                attempt = layout.attempt_of(path)
            except ValueError:
                continue
            found.setdefault(attempt, []).append((_object_kind(path, shard), path))
    return found


def _object_kind(path: str, shard: int) -> str:
    if path.endswith("/" + layout.CLAIM_NAME):
        return layout.CLAIM_NAME
    try:
        return parse_shard_object(path, shard).kind
    except ValueError:
        return "other"


def _last_activity(store: ObjectStore, claim: AttemptClaim | None, found: list[tuple[str, str]]) -> float | None:
    """Newest of the claim's start and the modification times of the attempt's newest object of each kind.

    Objects of one kind are written in index order, so the highest-named is the newest.
    """
    newest = {kind: path for kind, path in sorted(found) if kind in SHARD_FILE_KINDS}
    times = [claim.started_at] if claim is not None else []
    for path in newest.values():
        try:
            times.append(store.modified_at(path))
        except (FileNotFoundError, NotImplementedError):  # swept meanwhile, or a filesystem without times
            continue
    return max(times, default=None)
