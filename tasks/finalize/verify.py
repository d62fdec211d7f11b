"""Verify and linearize every receipt of a committed shard (ARCHITECTURE section 8).

Fail-closed rule: a rollout is trainable only when every link of its chain root→terminal is
proven against the committed bytes; anything else yields a :class:`VerifiedRollout` with a
stable reason from :mod:`tasks.finalize.reasons`, never an exception. One bad rollout, one bad
row, or one bad segment never stops the others: a segment that fails its checksum rejects only
the rollouts whose chains read it.

Order of the checks (the first failing one names the reason): receipt guards, manifest guards
(duplicates), terminal re-attribution and the chain's graph in the manifest, fetch, versions,
every compared field of the staged row against its call record and the batch config, malformed
rows, the recomputed digest, extras, parent lengths, the chain-hash walk, mask order, non-empty
generation, the terminal's cumulative hash. Guard reasons win over later ones, but a rollout
whose chain verified keeps its linearized tokens even when a guard rejects it.

Staged rows are checked as Arrow columns and numpy views, never as :class:`StagedDelta`
objects (whose constructor raises on exactly the malformed rows this module must name).
Token-level checks are vectorized over the whole chain; Python loops run per row only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.capture import digest as dg
from tasks.capture import terminal
from tasks.capture.records import CallRecord, Receipt, StagedDelta, canonical_json
from tasks.config import BatchConfig
from tasks.finalize import reasons as r
from tasks.finalize.verified import CallSpan, VerifiedRollout, WeightSpan
from tasks.plan import read_shard_plan
from tasks.schema import SchemaMismatchError
from tasks.storage.errors import SegmentChecksumMismatchError, StorageIntegrityError, UncommittedShardError
from tasks.storage.ledger import LedgerReader, RolloutBundle
from tasks.storage.objects import ObjectStore
from tasks.storage.staging import CommitCoordinates, StagedReader

log = logging.getLogger(__name__)

# Failure rows with this reason poison a rollout only when the failed call is on its chain.
OFF_CHAIN_TOLERATED_FAILURE = "request_finished_without_staged_coordinates"
# Poisoned receipts carrying one of these keep it; any other poisoned receipt is capture_poisoned.
RECEIPT_REASONS = frozenset((*r.TERMINAL_REASONS, r.NO_REWARD))
_I32_MAX = np.iinfo(np.int32).max
_NULL_EXTRAS_DIGEST = dg.compute_extras_digest(None)


@dataclass(frozen=True)
class _Chain:
    """The manifest's calls root→terminal, or the reason no chain can be trusted."""

    calls: tuple[CallRecord, ...] = ()
    reason: str | None = None


def verify_shard(
    store: ObjectStore, shard: int, config: BatchConfig, *, ledger: LedgerReader | None = None
) -> Iterator[VerifiedRollout]:
    """One :class:`VerifiedRollout` per planned rollout of ``shard``, in plan order.

    ``store`` is rooted at the batch directory. A planned rollout without a receipt is
    ``missing_receipt``; a receipt of another group is ``invalid_receipt`` (reported under the
    planned group); receipts of unplanned rollouts are logged and never yielded. Raises
    :class:`UncommittedShardError` when the shard has no marker (a precondition of finalization,
    not a property of one rollout). A ledger that fails its integrity checks rejects every
    planned rollout with that reason. The staged rows of all chains are fetched in bulk first:
    each segment is read once. ``ledger`` is the shard's reader when the caller already has one.
    """
    plan = read_shard_plan(store, config, shard)
    try:
        ledger = ledger if ledger is not None else LedgerReader(store, shard)
    except UncommittedShardError:
        raise
    except StorageIntegrityError as exc:
        for planned in plan:
            yield _rejected(config, planned.group_id, planned.rollout_id, exc.reason)
        return
    bundles = {bundle.rollout_id: bundle for bundle in ledger.rollouts()}
    chains = {rollout_id: _plan_chain(bundle) for rollout_id, bundle in bundles.items()}
    reader = StagedReader(store, segment_sha256=ledger.segment_sha256, cached_segments=1)
    fetched = fetch_chains(reader, {rid: chain.calls for rid, chain in chains.items() if chain.reason is None})
    shard_reason = None if ledger.marker.batch_id == config.batch_id else r.wrong("batch_id")
    for planned in plan:
        bundle = bundles.get(planned.rollout_id)
        if bundle is None:
            yield _rejected(config, planned.group_id, planned.rollout_id, r.MISSING_RECEIPT)
            continue
        verified = verify_rollout(bundle, fetched.get(planned.rollout_id, r.MISSING_STAGING_ROW), config)
        guard = shard_reason or (r.INVALID_RECEIPT if verified.group_id != planned.group_id else None)
        yield verified if guard is None else replace(verified, group_id=planned.group_id, reason=guard)
    unplanned = sorted(set(bundles) - {planned.rollout_id for planned in plan})
    if unplanned:
        log.warning("shard %d commits receipts of unplanned rollouts, not verified: %s", shard, unplanned[:10])


def fetch_chains(reader: StagedReader, chains: dict[str, Sequence[CallRecord]]) -> dict[str, pa.Table | str]:
    """rollout id -> its chain's staged rows in chain order, or the storage reason they cannot be read.

    Requests are grouped by segment and each segment is fetched once for every chain that reads
    it. A segment that cannot be trusted as a whole (checksum, schema, unparseable) rejects every
    chain reading it; a row-level failure (missing row, wrong key) is attributed per rollout by
    re-fetching that segment's rows rollout by rollout (from the reader's cache).
    """
    by_segment: dict[str, list[tuple[str, int]]] = {}
    for rollout_id, calls in chains.items():
        for position, call in enumerate(calls):
            by_segment.setdefault(call.staging_segment, []).append((rollout_id, position))
    failed: dict[str, str] = {}
    parts: list[pa.Table] = []
    index: dict[tuple[str, int], int] = {}
    offset = 0
    for segment, entries in by_segment.items():
        live = [e for e in entries if e[0] not in failed]
        loaded = _fetch_segment(reader, segment, live, chains, failed)
        for table, fetched_entries in loaded:
            for row, entry in enumerate(fetched_entries):
                index[entry] = offset + row
            offset += table.num_rows
            parts.append(table)
    combined = pa.concat_tables(parts) if parts else StagedDelta.arrow_schema().empty_table()
    fetched = [rid for rid in chains if rid not in failed]
    order = [index[(rid, position)] for rid in fetched for position in range(len(chains[rid]))]
    ordered = combined.take(pa.array(order, type=pa.int64()))  # one take; each rollout is a zero-copy slice
    result: dict[str, pa.Table | str] = dict(failed)
    start = 0
    for rollout_id in fetched:
        result[rollout_id] = ordered.slice(start, len(chains[rollout_id]))
        start += len(chains[rollout_id])
    return result


def _fetch_segment(
    reader: StagedReader,
    segment: str,
    entries: list[tuple[str, int]],
    chains: dict[str, Sequence[CallRecord]],
    failed: dict[str, str],
) -> list[tuple[pa.Table, list[tuple[str, int]]]]:
    """Fetched tables of one segment with the entries they hold; failures recorded in ``failed``."""

    def requests(of: list[tuple[str, int]]) -> list[tuple[str, CommitCoordinates]]:
        calls = [chains[rid][pos] for rid, pos in of]
        return [(c.staging_key, CommitCoordinates(c.staging_segment, c.staging_row)) for c in calls]

    if not entries:
        return []
    try:
        return [(reader.fetch(requests(entries)), entries)]
    except SegmentChecksumMismatchError as exc:
        whole_segment = exc.reason
    except pa.ArrowInvalid:
        whole_segment = r.INVALID_STAGED_ROW  # re-sealed bytes that are not a Parquet file
    except StorageIntegrityError as exc:
        if exc.reason == r.INVALID_STAGED_ROW:  # the segment's schema is not the staged-delta schema
            whole_segment = exc.reason
        else:
            return _fetch_per_rollout(reader, entries, requests, failed)
    for rollout_id, _ in entries:
        failed.setdefault(rollout_id, whole_segment)
    return []


def _fetch_per_rollout(
    reader: StagedReader,
    entries: list[tuple[str, int]],
    requests: Callable[[list[tuple[str, int]]], list[tuple[str, CommitCoordinates]]],
    failed: dict[str, str],
) -> list[tuple[pa.Table, list[tuple[str, int]]]]:
    by_rollout: dict[str, list[tuple[str, int]]] = {}
    for entry in entries:
        by_rollout.setdefault(entry[0], []).append(entry)
    loaded = []
    for rollout_id, own in by_rollout.items():
        try:
            loaded.append((reader.fetch(requests(own)), own))
        except StorageIntegrityError as exc:
            failed.setdefault(rollout_id, exc.reason)
    return loaded


def verify_rollout(bundle: RolloutBundle, staged_rows: pa.Table | str, config: BatchConfig) -> VerifiedRollout:
    """Verify one receipted rollout and linearize its chain; never raises for bad data.

    ``staged_rows`` are the staged rows of the chain root→terminal in that order (as
    :func:`fetch_chains` returns them), or the reason string of a failed fetch. The result has
    ``reason`` None exactly when the rollout is trainable; it keeps its tokens whenever the
    chain itself verified.
    """
    receipt = bundle.receipt
    guard = _receipt_reason(bundle)
    chain = _plan_chain(bundle)
    if chain.reason is not None:
        return _rejected_receipt(config, receipt, guard or chain.reason)
    guard = guard or _failure_reason(bundle, chain.calls)
    if isinstance(staged_rows, str):
        return _rejected_receipt(config, receipt, guard or staged_rows)
    linear = _verify_staged(chain.calls, staged_rows, config)
    if isinstance(linear, str):
        return _rejected_receipt(config, receipt, guard or linear)
    return replace(
        linear,
        batch_id=config.batch_id,
        group_id=receipt.group_id,
        reward=receipt.reward,
        reason=guard,
        terminal_selection=receipt.terminal_selection,
    )


# --- guards and the manifest graph ----------------------------------------------------------


def _receipt_reason(bundle: RolloutBundle) -> str | None:
    """What the receipt alone says: inconsistent with its manifest, failed, or poisoned."""
    receipt = bundle.receipt
    if receipt.num_calls != len(bundle.manifest):
        return r.INVALID_RECEIPT
    if receipt.status == "ok" and receipt.terminal_attribution_reason != terminal.SELECTED:
        return r.INVALID_RECEIPT
    if receipt.status == "failed":
        return r.ROLLOUT_FAILED
    if receipt.status == "poisoned":
        return receipt.failure_reason if receipt.failure_reason in RECEIPT_REASONS else r.CAPTURE_POISONED
    return None


def _failure_reason(bundle: RolloutBundle, chain: Sequence[CallRecord]) -> str | None:
    """Failure rows poison the rollout, except a tolerated reason on a call off the chain."""
    on_chain = {call.call_id for call in chain}
    for failure in bundle.failures:
        if failure.reason != OFF_CHAIN_TOLERATED_FAILURE or failure.call_id in on_chain:
            return r.CAPTURE_POISONED
    return None


def _plan_chain(bundle: RolloutBundle) -> _Chain:
    """The receipt's chain root→terminal in the manifest, after duplicate and attribution checks."""
    manifest = bundle.manifest
    call_ids = [call.call_id for call in manifest]
    if len(set(call_ids)) != len(call_ids):
        return _Chain(reason=r.DUPLICATE_MANIFEST_CALL_ID)
    coordinates = {(call.staging_segment, call.staging_row) for call in manifest}
    if len(coordinates) != len(manifest):
        return _Chain(reason=r.DUPLICATE_STAGING_KEY)
    reason = _attribution_reason(bundle)
    if reason is not None:
        return _Chain(reason=reason)
    by_id = {call.call_id: call for call in manifest}
    current = by_id[bundle.receipt.terminal_call_id]  # type: ignore[index]
    calls = [current]
    seen = {current.call_id}
    while current.parent_call_id is not None:
        if current.parent_call_id in seen:
            return _Chain(reason=r.LINEAGE_CYCLE)
        parent = by_id.get(current.parent_call_id)
        if parent is None:
            return _Chain(reason=r.MISSING_PARENT)
        seen.add(parent.call_id)
        calls.append(parent)
        current = parent
    return _Chain(calls=tuple(reversed(calls)))


def _attribution_reason(bundle: RolloutBundle) -> str | None:
    """Re-run terminal attribution on the manifest and compare with the receipt's terminal."""
    receipt = bundle.receipt
    declared = receipt.terminal_call_id
    if declared is None or all(call.call_id != declared for call in bundle.manifest):
        return r.MISSING_TERMINAL
    if receipt.terminal_selection == "heuristic":
        found = terminal.select_terminal_call(bundle.manifest)
        if found.terminal_call_id is None:
            return found.reason
        if found.terminal_call_id != declared:
            return terminal.WITNESS_DISAGREEMENT
    return None


# --- staged rows ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Columns:
    """A chain's staged rows as Python scalars per row and flat numpy token arrays."""

    scalars: dict[str, list]
    ids: np.ndarray  # int64, all deltas root→terminal
    mask: np.ndarray  # float32
    logprobs: np.ndarray  # float32
    starts: np.ndarray  # int64 offset of each row's delta in the flat arrays, plus the total at the end


_LIST_COLUMNS = ("token_ids_delta", "token_mask_delta", "logprobs_delta")


def _columns(table: pa.Table) -> _Columns | str:
    flats, lengths = {}, {}
    for name in _LIST_COLUMNS:
        column = table.column(name).combine_chunks()
        values = column.flatten()
        if values.null_count:
            return r.INVALID_STAGED_ROW
        flats[name] = values.to_numpy(zero_copy_only=False)
        lengths[name] = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    scalars = {name: table.column(name).to_pylist() for name in table.column_names if name not in _LIST_COLUMNS}
    delta_len = np.asarray(scalars["delta_len"], dtype=np.int64)
    if any(not np.array_equal(length, delta_len) for length in lengths.values()):
        return r.INVALID_STAGED_ROW
    starts = np.zeros(delta_len.size + 1, np.int64)
    np.cumsum(delta_len, out=starts[1:])
    return _Columns(
        scalars=scalars,
        ids=flats["token_ids_delta"],
        mask=flats["token_mask_delta"],
        logprobs=flats["logprobs_delta"],
        starts=starts,
    )


def _verify_staged(chain: Sequence[CallRecord], table: pa.Table, config: BatchConfig) -> VerifiedRollout | str:
    """The linearized chain (identity fields left for the caller), or the first reason it fails."""
    if not _has_staged_schema(table):
        return r.INVALID_STAGED_ROW
    if table.num_rows != len(chain):
        return r.MISSING_STAGING_ROW
    for name, reason in (("rollout_id", r.STAGING_KEY_MISMATCH), ("call_id", r.CALL_ID_MISMATCH)):
        if table.column(name).to_pylist() != [getattr(call, name) for call in chain]:
            return reason
    for name, expected, reason in (
        ("schema_version", dg.SCHEMA_VERSION, r.UNSUPPORTED_SCHEMA),
        ("digest_version", dg.DIGEST_VERSION, r.UNSUPPORTED_DIGEST),
        ("extras_digest_version", dg.EXTRAS_DIGEST_VERSION, r.UNSUPPORTED_DIGEST),
    ):
        if any(value != expected for value in table.column(name).to_pylist()):
            return reason
    for name in r.MANIFEST_FIELDS:
        if table.column(name).to_pylist() != [getattr(call, name) for call in chain]:
            return r.wrong(name)
    if any(value != config.batch_id for value in table.column("batch_id").to_pylist()):
        return r.wrong("batch_id")
    for name in r.SAMPLING_FIELDS:
        expected = getattr(config.sampling, name)
        if any(value != expected for value in table.column(name).to_pylist()):
            return r.wrong(name)
    columns = _columns(table)
    if isinstance(columns, str):
        return columns
    return (
        _malformed(columns)
        or _corrupt_digest(columns)
        or _corrupt_extras(columns)
        or _broken_links(columns)
        or _linearize(chain, columns)
    )


def _has_staged_schema(table: pa.Table) -> bool:
    """Exactly the staged-delta columns and types, no nulls where the schema forbids them."""
    schema = StagedDelta.arrow_schema()
    if not table.schema.equals(schema):
        try:
            StagedDelta.check_table(table, source="staged rows")  # the slow path also accepts a reordering
        except SchemaMismatchError:
            return False
        table = table.select(schema.names)
    return not any(table.column(f.name).null_count for f in schema if not f.nullable)


def _malformed(c: _Columns) -> str | None:
    """Token ids in [0, int32], masks exactly 0/1, logprobs finite and exactly 0 where carried."""
    if c.ids.size and (c.ids.min() < 0 or c.ids.max() > _I32_MAX):
        return r.INVALID_STAGED_ROW
    carried = c.mask == 0.0
    if not (carried | (c.mask == 1.0)).all():
        return r.INVALID_STAGED_ROW
    if not np.isfinite(c.logprobs).all() or (c.logprobs[carried] != 0.0).any():
        return r.INVALID_STAGED_ROW
    return None


def _corrupt_digest(c: _Columns) -> str | None:
    s = c.scalars
    ids = c.ids.view(np.uint64)
    for i in range(len(s["digest"])):
        lo, hi = c.starts[i], c.starts[i + 1]
        recomputed = dg.digest_of_checked_call(
            rollout_id=s["rollout_id"][i],
            call_id=s["call_id"][i],
            parent_call_id=s["parent_call_id"][i],
            mode=s["mode"][i],
            prev_len=s["prev_len"][i],
            delta_len=s["delta_len"][i],
            cum_len=s["cum_len"][i],
            weight_version=s["weight_version"][i],
            ids=ids[lo:hi],
            mask=c.mask[lo:hi],
            logprobs=c.logprobs[lo:hi],
            extras_digest=s["extras_digest"][i],
            chain_hash=s["chain_hash"][i],
            cumulative_hash=s["cumulative_hash"][i],
        )
        if recomputed != s["digest"][i]:
            return r.CORRUPT_DIGEST
    return None


def _corrupt_extras(c: _Columns) -> str | None:
    """extras_json parses, is canonical, and its digest is the stored extras digest."""
    for text, stored in zip(c.scalars["extras_json"], c.scalars["extras_digest"], strict=True):
        if text == "null" and stored == _NULL_EXTRAS_DIGEST:
            continue
        try:
            extras = json.loads(text)
            if canonical_json(extras) != text or dg.compute_extras_digest(extras) != stored:
                return r.CORRUPT_EXTRAS
        except (ValueError, TypeError):  # invalid JSON, NaN, values the extras encoding refuses
            return r.CORRUPT_EXTRAS
    return None


def _broken_links(c: _Columns) -> str | None:
    """Parent lengths, the chain-hash walk, carried-then-sampled masks, a sampled token per call."""
    s = c.scalars
    if any(s["prev_len"][i] != s["cum_len"][i - 1] for i in range(1, len(s["prev_len"]))):
        return r.PARENT_LENGTH_MISMATCH
    ids = c.ids.view(np.uint64)
    parent_hash = None
    for i, stored in enumerate(s["chain_hash"]):
        if dg.chain_hash_of_checked(parent_hash, ids[c.starts[i] : c.starts[i + 1]]) != stored:
            return r.CHAIN_HASH_MISMATCH
        parent_hash = stored
    descending = np.flatnonzero(c.mask[1:] < c.mask[:-1]) + 1
    if np.isin(descending, c.starts[1:-1], invert=True).any():
        return r.INVALID_MASK_ORDER
    sampled = np.add.reduceat(c.mask, c.starts[:-1]) if c.mask.size else np.zeros(0)
    if (sampled == 0).any():
        return r.EMPTY_GENERATION
    return None


def _linearize(chain: Sequence[CallRecord], c: _Columns) -> VerifiedRollout | str:
    """Concatenate the deltas root→terminal, after proving the terminal's cumulative hash."""
    if dg.cumulative_hash_of_parts(c.ids.view(np.uint64)) != chain[-1].cumulative_hash:
        return r.CUMULATIVE_HASH_MISMATCH
    sampled = np.add.reduceat(c.mask, c.starts[:-1]).astype(np.int64)
    lengths = np.diff(c.starts)
    call_spans = tuple(
        CallSpan(call_id=call.call_id, carry_len=int(n - k), gen_len=int(k))
        for call, n, k in zip(chain, lengths, sampled, strict=True)
    )
    weight_spans = tuple(
        WeightSpan(call_id=call.call_id, start=int(lo), end=int(hi), weight_version=call.weight_version)
        for call, lo, hi in zip(chain, c.starts[:-1], c.starts[1:], strict=True)
    )
    terminal_call = chain[-1]
    return VerifiedRollout(
        batch_id=terminal_call.batch_id,
        group_id="",
        rollout_id=terminal_call.rollout_id,
        reward=None,
        reason=None,
        input_ids=_frozen(c.ids.astype(np.int32)),
        loss_mask=_frozen(c.mask.astype(np.uint8)),
        logprobs=_frozen(c.logprobs.astype(np.float32, copy=True)),
        prompt_len=call_spans[0].carry_len,
        call_spans=call_spans,
        weight_spans=weight_spans,
        truncated=terminal_call.finish_reason == "length",
        num_turns=len(chain),
        epoch_span_count=sum(call.epoch_span for call in chain),
    )


# --- results ----------------------------------------------------------------------------------


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _rejected(config: BatchConfig, group_id: str, rollout_id: str, reason: str) -> VerifiedRollout:
    """A rollout without a receipt, or whose receipt is unreadable: no tokens, no reward."""
    return VerifiedRollout(
        batch_id=config.batch_id, group_id=group_id, rollout_id=rollout_id, reward=None, reason=reason
    )


def _rejected_receipt(config: BatchConfig, receipt: Receipt, reason: str) -> VerifiedRollout:
    """A receipted rollout whose chain could not be verified: no tokens, the receipt's reward."""
    return VerifiedRollout(
        batch_id=config.batch_id,
        group_id=receipt.group_id,
        rollout_id=receipt.rollout_id,
        reward=receipt.reward,
        reason=reason,
        terminal_selection=receipt.terminal_selection,
    )
