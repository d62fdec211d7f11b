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
objects (whose constructor raises on exactly the malformed rows this module must name). The
staged rows of a whole shard are checked at once (:func:`verify_chains`): columns are converted
once, field comparisons and token checks are vectorized, digests hash slices of one big-endian
buffer (:mod:`tasks.capture.digest_batch`), and each chain's reason is the earliest check any of
its rows fails, exactly as if the chain were checked alone. Python loops run per row only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.capture import digest as dg
from tasks.capture import digest_batch as db
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
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import CommitCoordinates

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
    staged: dict[str, VerifiedRollout | str] = dict(fetched.failed)
    results = verify_chains([chains[rid].calls for rid in fetched.spans], fetched.table, config)
    staged.update(zip(fetched.spans, results, strict=True))
    del fetched, results  # linearized rollouts hold copies: the shard's staged rows can go
    shard_reason = None if ledger.marker.batch_id == config.batch_id else r.wrong("batch_id")
    for planned in plan:
        bundle = bundles.get(planned.rollout_id)
        if bundle is None:
            yield _rejected(config, planned.group_id, planned.rollout_id, r.MISSING_RECEIPT)
            continue
        rid = planned.rollout_id
        verified = _verified(bundle, chains[rid], staged.get(rid, r.MISSING_STAGING_ROW), config)
        guard = shard_reason or (r.INVALID_RECEIPT if verified.group_id != planned.group_id else None)
        yield verified if guard is None else replace(verified, group_id=planned.group_id, reason=guard)
    unplanned = sorted(set(bundles) - {planned.rollout_id for planned in plan})
    if unplanned:
        log.warning("shard %d commits receipts of unplanned rollouts, not verified: %s", shard, unplanned[:10])


@dataclass(frozen=True)
class FetchedChains:
    """The staged rows of every fetched chain in one table, chain after chain, each root→terminal.

    ``spans`` maps a rollout id to its chain's first row and row count in ``table``;
    ``failed`` maps a rollout id to the storage reason its rows cannot be read.
    """

    table: pa.Table
    spans: dict[str, tuple[int, int]]
    failed: dict[str, str]


def fetch_chains(reader: StagedReader, chains: dict[str, Sequence[CallRecord]]) -> FetchedChains:
    """Every chain's staged rows in chain order, or the storage reason they cannot be read.

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
    spans: dict[str, tuple[int, int]] = {}
    start = 0
    for rollout_id in fetched:
        spans[rollout_id] = (start, len(chains[rollout_id]))
        start += len(chains[rollout_id])
    indices = np.asarray(order, dtype=np.int64)
    if indices.size != combined.num_rows or (indices != np.arange(indices.size)).any():
        combined = combined.take(pa.array(indices))  # one take, only when chains are not already in order
    return FetchedChains(table=combined, spans=spans, failed=failed)


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

    ``staged_rows`` are the staged rows of the chain root→terminal in that order, or the reason
    string of a failed fetch. The result has ``reason`` None exactly when the rollout is
    trainable; it keeps its tokens whenever the chain itself verified.
    """
    chain = _plan_chain(bundle)
    staged = staged_rows
    if chain.reason is None and not isinstance(staged_rows, str):
        staged = _verify_one(chain.calls, staged_rows, config)
    return _verified(bundle, chain, staged, config)


def _verified(
    bundle: RolloutBundle, chain: _Chain, staged: VerifiedRollout | str, config: BatchConfig
) -> VerifiedRollout:
    """Combine the receipt guards, the chain's graph and the staged rows' verdict (guards win)."""
    receipt = bundle.receipt
    guard = _receipt_reason(bundle)
    if chain.reason is not None:
        return _rejected_receipt(config, receipt, guard or chain.reason)
    guard = guard or _failure_reason(bundle, chain.calls)
    if isinstance(staged, str):
        return _rejected_receipt(config, receipt, guard or staged)
    return replace(
        staged,
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

_STAGED_SCHEMA = StagedDelta.arrow_schema()
_LIST_COLUMNS = ("token_ids_delta", "token_mask_delta", "logprobs_delta")
_PASSING = np.iinfo(np.int32).max  # the check index of a row that has not failed yet


def verify_chains(
    chains: Sequence[Sequence[CallRecord]], table: pa.Table, config: BatchConfig
) -> list[VerifiedRollout | str]:
    """Verify the staged rows of many chains at once: per chain, its linearization or first failing reason.

    ``table`` holds the rows of every chain, chain after chain, each root→terminal (as
    :func:`fetch_chains` returns them). Every check runs over the whole table; a chain's reason
    is the earliest check (in the module's order) that any of its rows fails, exactly as if its
    rows were checked alone. Identity fields of a linearized rollout are left for the caller.
    """
    lengths = [len(chain) for chain in chains]
    if table.num_rows != sum(lengths) or 0 in lengths:
        raise ValueError(f"{table.num_rows} staged rows for chains of {lengths[:10]} calls (each at least one)")
    if not chains:
        return []
    conformed = _conformed(table)
    if conformed is None:
        return [r.INVALID_STAGED_ROW] * len(chains)
    first_rows = np.zeros(len(chains), np.int64)
    np.cumsum(lengths[:-1], out=first_rows[1:])
    staged = _StagedRows(conformed, [call for chain in chains for call in chain], first_rows, config)
    failing = np.minimum.reduceat(staged.checks.first, first_rows)
    results: list[VerifiedRollout | str] = []
    for chain, first, check in zip(chains, first_rows.tolist(), failing.tolist(), strict=True):
        if check != _PASSING:
            results.append(staged.checks.reasons[check])
        else:
            results.append(staged.linearize(chain, first))
    return results


def _verify_one(chain: Sequence[CallRecord], table: pa.Table, config: BatchConfig) -> VerifiedRollout | str:
    """The staged rows of one chain: a row count that differs from the chain's is ``missing_staging_row``."""
    if table.num_rows != len(chain):
        conformed = _conformed(table)
        return r.INVALID_STAGED_ROW if conformed is None or _null_rows(conformed).any() else r.MISSING_STAGING_ROW
    return verify_chains([chain], table, config)[0]


def _conformed(table: pa.Table) -> pa.Table | None:
    """The table with exactly the staged-delta columns and types (a reordering accepted), or None."""
    if table.schema.equals(_STAGED_SCHEMA):
        return table
    try:
        StagedDelta.check_table(table, source="staged rows")
    except SchemaMismatchError:
        return None
    return table.select(_STAGED_SCHEMA.names)


def _null_rows(table: pa.Table) -> np.ndarray:
    """Rows with a null where the staged-delta schema forbids one."""
    nulls = np.zeros(table.num_rows, dtype=bool)
    for f in _STAGED_SCHEMA:
        column = table.column(f.name)
        if not f.nullable and column.null_count:
            nulls |= pc.is_null(column).to_numpy(zero_copy_only=False)
    return nulls


class _Checks:
    """The first failing check of every row; checks are recorded in the order they are defined."""

    def __init__(self, rows: int) -> None:
        self.first = np.full(rows, _PASSING, dtype=np.int32)
        self.reasons: list[str] = []

    def record(self, reason: str, failing: np.ndarray) -> None:
        """Record the next check; ``failing`` is a boolean mask over rows or an array of row indices."""
        index = len(self.reasons)
        self.reasons.append(reason)
        if failing.dtype == bool:
            failing = np.flatnonzero(failing)
        self.first[failing] = np.minimum(self.first[failing], index)

    def passing(self) -> np.ndarray:
        """Indices of the rows that passed every check so far."""
        return np.flatnonzero(self.first == _PASSING)


class _StagedRows:
    """Every check of section 8 over the staged rows of many chains, columns converted once.

    Field comparisons use the chains' call records; token checks and hashes run over the flat
    token lists of ``self.rows``: the rows that passed every check up to the list lengths, in
    table order (a row failing an earlier check already decided its chain's reason).
    """

    def __init__(self, table: pa.Table, calls: list[CallRecord], first_rows: np.ndarray, config: BatchConfig) -> None:
        n = table.num_rows
        self.checks = checks = _Checks(n)
        self.chain_start = np.zeros(n, dtype=bool)
        self.chain_start[first_rows] = True
        self.recorded = {
            name: list(map(attrgetter(name), calls)) for name in ("rollout_id", "call_id", *r.MANIFEST_FIELDS)
        }
        checks.record(r.INVALID_STAGED_ROW, _null_rows(table))
        for name, reason in (("rollout_id", r.STAGING_KEY_MISMATCH), ("call_id", r.CALL_ID_MISMATCH)):
            checks.record(reason, _differs(table.column(name), self.recorded[name]))
        for name, expected, reason in (
            ("schema_version", dg.SCHEMA_VERSION, r.UNSUPPORTED_SCHEMA),
            ("digest_version", dg.DIGEST_VERSION, r.UNSUPPORTED_DIGEST),
            ("extras_digest_version", dg.EXTRAS_DIGEST_VERSION, r.UNSUPPORTED_DIGEST),
        ):
            checks.record(reason, _differs_from(table.column(name), expected))
        for name in r.MANIFEST_FIELDS:
            checks.record(r.wrong(name), _differs(table.column(name), self.recorded[name]))
        checks.record(r.wrong("batch_id"), _differs_from(table.column("batch_id"), config.batch_id))
        for name in r.SAMPLING_FIELDS:
            checks.record(r.wrong(name), _differs_from(table.column(name), getattr(config.sampling, name)))
        self._load_tokens(table)
        self._check_tokens()
        self._check_digests()
        self._check_extras(table.column("extras_json"))
        self._check_links(table)

    def _load_tokens(self, table: pa.Table) -> None:
        """Check that the three lists are null-free and ``delta_len`` long; flatten the passing rows once."""
        delta_len = pc.fill_null(table.column("delta_len"), -1).to_numpy(zero_copy_only=False)
        lists = {name: table.column(name).combine_chunks() for name in _LIST_COLUMNS}
        bad = np.zeros(table.num_rows, dtype=bool)
        for column in lists.values():
            lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
            bad |= lengths != delta_len
            values = column.flatten()
            if values.null_count:
                null_tokens = np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))
                bad[_owners(_starts(lengths), null_tokens)] = True
        self.checks.record(r.INVALID_STAGED_ROW, bad)
        self.rows = self.checks.passing()
        if self.rows.size != table.num_rows:
            lists = {name: column.take(pa.array(self.rows)) for name, column in lists.items()}
        flat = {name: column.flatten().to_numpy(zero_copy_only=False) for name, column in lists.items()}
        self.ids, self.mask, self.logprobs = (flat[name] for name in _LIST_COLUMNS)
        self.starts = _starts(delta_len[self.rows])
        self.position = np.full(table.num_rows, -1, dtype=np.int64)  # table row -> index into self.rows
        self.position[self.rows] = np.arange(self.rows.size)

    def _check_tokens(self) -> None:
        """Token ids in [0, int32], masks exactly 0/1, logprobs finite and exactly 0 where carried."""
        ids, mask, logprobs = self.ids, self.mask, self.logprobs
        carried = mask == 0.0
        bad = (ids < 0) | (ids > _I32_MAX) | ~(carried | (mask == 1.0)) | ~np.isfinite(logprobs)
        bad |= carried & (logprobs != 0.0)
        self.checks.record(r.INVALID_STAGED_ROW, self.rows[_owners(self.starts, np.flatnonzero(bad))])
        self.tokens = db.FlatTokens.of(ids.view(np.uint64), mask, logprobs, self.starts)

    def _check_digests(self) -> None:
        """The call digest recomputed over the stored row equals the stored digest."""
        todo = self.checks.passing()
        recorded = self.recorded
        if self.rows.size != self.position.size:  # index the scalars like the token rows
            recorded = {name: [values[i] for i in self.rows] for name, values in recorded.items()}
        recomputed = db.call_digests(self.tokens, recorded, self.position[todo].tolist())
        stored = recorded["digest"]
        wrong = [
            row for row, i, digest in zip(todo, self.position[todo], recomputed, strict=True) if digest != stored[i]
        ]
        self.checks.record(r.CORRUPT_DIGEST, np.array(wrong, dtype=np.int64))

    def _check_extras(self, extras_json: pa.ChunkedArray) -> None:
        """extras_json parses, is canonical, and its digest is the stored extras digest."""
        todo = self.checks.passing()
        texts = extras_json.take(pa.array(todo, type=pa.int64())).to_pylist()
        stored = self.recorded["extras_digest"]
        wrong = [row for row, text in zip(todo.tolist(), texts, strict=True) if not _extras_match(text, stored[row])]
        self.checks.record(r.CORRUPT_EXTRAS, np.array(wrong, dtype=np.int64))

    def _check_links(self, table: pa.Table) -> None:
        """Parent lengths, the chain-hash walk, carried-then-sampled masks, a sampled token per call."""
        prev_len = pc.fill_null(table.column("prev_len"), 0).to_numpy(zero_copy_only=False)
        cum_len = pc.fill_null(table.column("cum_len"), 0).to_numpy(zero_copy_only=False)
        child = np.flatnonzero(~self.chain_start)
        self.checks.record(r.PARENT_LENGTH_MISMATCH, child[prev_len[child] != cum_len[child - 1]])
        todo = self.checks.passing()
        walkable = todo[self.chain_start[todo] | np.isin(todo - 1, todo)]  # a failed parent already failed the chain
        stored = self.recorded["chain_hash"]
        rows = walkable.tolist()
        parents = [None if self.chain_start[i] else stored[i - 1] for i in rows]
        walked = db.chain_hashes(self.tokens, parents, self.position[walkable].tolist())
        wrong = [i for i, recomputed in zip(rows, walked, strict=True) if recomputed != stored[i]]
        self.checks.record(r.CHAIN_HASH_MISMATCH, np.array(wrong, dtype=np.int64))
        descending = np.flatnonzero(self.mask[1:] < self.mask[:-1]) + 1
        inside = descending[np.isin(descending, self.starts, invert=True)]
        self.checks.record(r.INVALID_MASK_ORDER, self.rows[_owners(self.starts, inside)])
        nonempty = self.starts[1:] > self.starts[:-1]
        self.sampled = np.zeros(self.rows.size, dtype=np.int64)  # sampled tokens per row
        if self.mask.size:
            self.sampled[nonempty] = np.add.reduceat(self.mask == 1.0, self.starts[:-1][nonempty], dtype=np.int64)
        self.checks.record(r.EMPTY_GENERATION, self.rows[self.sampled == 0])

    def linearize(self, chain: Sequence[CallRecord], first: int) -> VerifiedRollout | str:
        """Concatenate a chain's deltas root→terminal (every row passed), after its cumulative hash."""
        lo_row = int(self.position[first])
        hi_row = lo_row + len(chain)
        if db.cumulative_hash(self.tokens, lo_row, hi_row) != chain[-1].cumulative_hash:
            return r.CUMULATIVE_HASH_MISMATCH
        starts = self.starts[lo_row : hi_row + 1]
        lo, hi = int(starts[0]), int(starts[-1])
        sampled = self.sampled[lo_row:hi_row].tolist()
        bounds = (starts - lo).tolist()
        call_spans = tuple(
            CallSpan(call_id=call.call_id, carry_len=end - begin - k, gen_len=k)
            for call, begin, end, k in zip(chain, bounds[:-1], bounds[1:], sampled, strict=True)
        )
        weight_spans = tuple(
            WeightSpan(call_id=call.call_id, start=begin, end=end, weight_version=call.weight_version)
            for call, begin, end in zip(chain, bounds[:-1], bounds[1:], strict=True)
        )
        terminal_call = chain[-1]
        return VerifiedRollout(
            batch_id=terminal_call.batch_id,
            group_id="",
            rollout_id=terminal_call.rollout_id,
            reward=None,
            reason=None,
            input_ids=_frozen(self.ids[lo:hi].astype(np.int32)),
            loss_mask=_frozen(self.mask[lo:hi].astype(np.uint8)),
            logprobs=_frozen(self.logprobs[lo:hi].copy()),
            prompt_len=call_spans[0].carry_len,
            call_spans=call_spans,
            weight_spans=weight_spans,
            truncated=terminal_call.finish_reason == "length",
            num_turns=len(chain),
            epoch_span_count=sum(call.epoch_span for call in chain),
        )


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Offsets of consecutive segments of ``lengths``, plus the total at the end."""
    starts = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    return starts


def _owners(starts: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The segment (of ``starts``) holding each flat position."""
    return np.searchsorted(starts, positions, side="right") - 1


def _differs(column: pa.ChunkedArray, expected: list) -> np.ndarray:
    """Rows where the column's value != the expected Python value (null equals only None)."""
    try:
        other = pa.array(expected, type=column.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):  # a value the column type cannot hold
        return np.array([a != b for a, b in zip(column.to_pylist(), expected, strict=True)], dtype=bool)
    column = column.combine_chunks()
    same = pc.or_(pc.fill_null(pc.equal(column, other), False), pc.and_(pc.is_null(column), pc.is_null(other)))
    return ~same.to_numpy(zero_copy_only=False)


def _differs_from(column: pa.ChunkedArray, expected: object) -> np.ndarray:
    """Rows where the column's value != ``expected`` (Python comparison, over the distinct values first)."""
    if all(value == expected for value in column.unique().to_pylist()):
        return np.zeros(len(column), dtype=bool)
    return np.array([value != expected for value in column.to_pylist()], dtype=bool)


def _extras_match(text: str, stored: str) -> bool:
    """extras_json parses, is canonical, and its digest is ``stored``."""
    if text == "null" and stored == _NULL_EXTRAS_DIGEST:
        return True
    try:
        extras = json.loads(text)
        return canonical_json(extras) == text and dg.compute_extras_digest(extras) == stored
    except (ValueError, TypeError):  # invalid JSON, NaN, values the extras encoding refuses
        return False


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
