"""The chain of every receipted rollout of a shard, found before any token is read (docs/architecture.md §8).

A rollout's manifest is what the one rule says (:func:`tasks.storage.rollout_manifest.rollout_manifests`:
the calls its receipt replayed, then its call records in its receipt's attempt); its chain is the
calls root→terminal, found by following parents up from the receipt's terminal call. A manifest
that cannot give a trustworthy chain has a named reason, in this order: an incomplete manifest (a
replayed call no earlier attempt recorded: the rule's policy), duplicate call ids, shared staging
coordinates, terminal re-attribution, then a cycle or a missing parent on the walk
(:func:`_walk_chain`).

Under ``message_graph: independent`` a rollout whose calls are all roots (a gateway agent's: no
call's tokens depend on another's) has one chain per call instead, in ledger order, each the call
alone: every call is its own training row. Its manifest passes the same checks first.

Nearly every manifest is a plain linear chain in ledger order: the first call is the root, each
later call's parent is the call before it, call ids and staging coordinates are distinct, and the
declared (not heuristic) terminal is the last call. Then every check above passes and the chain
is the manifest itself. :func:`shard_chains` recognizes those manifests column-wise and walks
only the others record by record, so the result is the walk's for every manifest.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.capture import terminal
from tasks.finalize import reasons as r
from tasks.finalize.ragged import offsets, owners, take_rows
from tasks.records.ledger import CallRecord, FailureRow, Receipt
from tasks.storage.ledger_reader import LedgerTables
from tasks.storage.rollout_manifest import own_rows, receipts_table, rollout_manifests


@dataclass(frozen=True)
class _Chain:
    """The manifest's calls root→terminal, or the reason no chain can be trusted."""

    calls: tuple[CallRecord, ...] = ()
    reason: str | None = None


@dataclass(frozen=True)
class ShardChains:
    """Per receipt (in the order given): its manifest's size, its failure rows, and its chains or why none.

    ``rows`` lists the calls-table rows of every chain, chain after chain, each root→terminal;
    chain ``k`` is ``rows[starts[k]:starts[k + 1]]`` (never empty). Receipt ``i`` has chains
    ``receipt_starts[i]:receipt_starts[i + 1]``: none exactly when ``reasons[i]`` is set, one
    (root→terminal), or one per call (independent calls, see the module docstring).
    """

    manifest_sizes: list[int]
    failures: list[tuple[FailureRow, ...]]
    reasons: list[str | None]
    rows: np.ndarray
    starts: np.ndarray
    receipt_starts: np.ndarray

    def receipt_rows(self, receipt: int) -> np.ndarray:
        """The calls-table rows of every chain of ``receipt``."""
        lo, hi = self.receipt_starts[receipt], self.receipt_starts[receipt + 1]
        return self.rows[self.starts[lo] : self.starts[hi]]


def shard_chains(tables: LedgerTables, receipts: Sequence[Receipt], *, independent: bool = False) -> ShardChains:
    """The chains of each receipt's rollout from the shard's ledger tables (see the module docstring).

    ``independent``: the batch's ``message_graph`` is ``independent``.
    """
    receipt_table = receipts_table(receipts)
    manifests = rollout_manifests(tables.calls, tables.call_attempts, receipt_table)
    manifest, manifest_starts = manifests.rows, manifests.starts
    linear = _linear_manifests(take_rows(tables.calls, manifest), manifest_starts, receipts)
    chains: list[np.ndarray] = []
    counts: list[int] = []
    reasons: list[str | None] = []
    for i, receipt in enumerate(receipts):
        rows = manifest[manifest_starts[i] : manifest_starts[i + 1]]
        if not manifests.complete(i):  # the one rule's policy: fail closed
            reasons.append(r.MISSING_REPLAYED_CALL)
            counts.append(0)
            continue
        if linear[i]:
            chains.append(rows)
            counts.append(1)
            reasons.append(None)
            continue
        records = CallRecord.from_checked_table(tables.calls.take(pa.array(rows, pa.int64())))
        chain = _walk_chain(receipt, records)
        reasons.append(chain.reason)
        if chain.reason is not None:
            counts.append(0)
        elif independent and all(call.parent_call_id is None for call in records):
            chains.extend(rows[k : k + 1] for k in range(rows.size))
            counts.append(rows.size)
        else:
            row_of = {id(record): row for record, row in zip(records, rows.tolist(), strict=True)}
            chains.append(np.array([row_of[id(call)] for call in chain.calls], np.int64))
            counts.append(1)
    failure_rows, failure_starts = own_rows(tables.failures, tables.failure_attempts, receipt_table)
    failure_records = FailureRow.from_checked_table(tables.failures.take(pa.array(failure_rows, pa.int64())))
    return ShardChains(
        manifest_sizes=manifests.sizes.tolist(),
        failures=[tuple(failure_records[lo:hi]) for lo, hi in itertools.pairwise(failure_starts)],
        reasons=reasons,
        rows=np.concatenate([np.zeros(0, np.int64), *chains]),
        starts=offsets([c.size for c in chains]),
        receipt_starts=offsets(counts),
    )


def _linear_manifests(calls: pa.Table, starts: np.ndarray, receipts: Sequence[Receipt]) -> np.ndarray:
    """Per receipt: whether its manifest (``calls`` rows ``starts[i]:starts[i + 1]``) is a plain linear chain."""
    sizes = np.diff(starts)
    owner = owners(starts)
    first = np.zeros(calls.num_rows, bool)
    first[starts[:-1][sizes > 0]] = True
    call_ids = calls.column("call_id").combine_chunks()
    parents = calls.column("parent_call_id").combine_chunks()
    linked = pc.is_null(parents).to_numpy(zero_copy_only=False)  # a root, where a manifest starts
    if calls.num_rows > 1:
        follows = pc.fill_null(pc.equal(parents[1:], call_ids[:-1]), False).to_numpy(zero_copy_only=False)
        linked[1:] = np.where(first[1:], linked[1:], follows)
    ok = sizes > 0
    ok &= np.bincount(owner, weights=~linked, minlength=sizes.size) == 0
    ok &= ~_repeats_per_run(owner, sizes.size, [call_ids])
    ok &= ~_repeats_per_run(owner, sizes.size, [calls.column("staging_segment"), calls.column("staging_row")])
    declared = pa.array([rc.terminal_call_id for rc in receipts], pa.string())
    last = np.maximum(starts[1:] - 1, 0)
    if calls.num_rows:
        ok &= pc.fill_null(pc.equal(call_ids.take(pa.array(last)), declared), False).to_numpy(zero_copy_only=False)
    ok &= np.array([rc.terminal_selection != "heuristic" for rc in receipts], bool)
    return ok


def _repeats_per_run(owner: np.ndarray, runs: int, columns: list[pa.Array | pa.ChunkedArray]) -> np.ndarray:
    """Per run (rows sharing an ``owner``): whether two of its rows have equal values in every given column."""
    repeats = np.zeros(runs, bool)
    if owner.size < 2:
        return repeats
    names = [f"c{i}" for i in range(len(columns))]
    keyed = pa.table({"owner": owner, **dict(zip(names, columns, strict=True))})
    order = pc.sort_indices(keyed, sort_keys=[("owner", "ascending"), *((n, "ascending") for n in names)])
    ordered = keyed.take(order)
    same = np.ones(ordered.num_rows - 1, bool)
    for name in ("owner", *names):
        column = ordered.column(name).combine_chunks()
        same &= pc.fill_null(pc.equal(column[1:], column[:-1]), False).to_numpy(zero_copy_only=False)
    repeats[ordered.column("owner").to_numpy()[1:][same]] = True
    return repeats


def _walk_chain(receipt: Receipt, manifest: Sequence[CallRecord]) -> _Chain:
    """The receipt's chain root→terminal in the manifest, after duplicate and attribution checks."""
    call_ids = [call.call_id for call in manifest]
    if len(set(call_ids)) != len(call_ids):
        return _Chain(reason=r.DUPLICATE_MANIFEST_CALL_ID)
    coordinates = {(call.staging_segment, call.staging_row) for call in manifest}
    if len(coordinates) != len(manifest):
        return _Chain(reason=r.DUPLICATE_STAGING_KEY)
    reason = _attribution_reason(receipt, manifest)
    if reason is not None:
        return _Chain(reason=reason)
    by_id = {call.call_id: call for call in manifest}
    current = by_id[receipt.terminal_call_id]  # type: ignore[index]
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


def _attribution_reason(receipt: Receipt, manifest: Sequence[CallRecord]) -> str | None:
    """Re-run terminal attribution on the manifest and compare with the receipt's terminal."""
    declared = receipt.terminal_call_id
    if declared is None or all(call.call_id != declared for call in manifest):
        return r.MISSING_TERMINAL
    if receipt.terminal_selection == "heuristic":
        found = terminal.select_terminal_call(manifest)
        if found.terminal_call_id is None:
            return found.reason
        if found.terminal_call_id != declared:
            return terminal.WITNESS_DISAGREEMENT
    return None
