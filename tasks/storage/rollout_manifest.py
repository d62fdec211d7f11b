"""Which calls make up a receipted rollout: the one rule (docs/architecture.md §8), and what a missing call does.

A receipt's *manifest* is the calls it replayed (``replayed_calls``: call records of its rollout in
attempts before the receipt's, in replay order), then its rollout's call records in the receipt's
own attempt, in ledger order. Its *failures* are its rollout's failure rows in the receipt's
attempt. Rows of rollouts without a receipt in their attempt (a dead attempt's leftovers) belong
to no manifest.

A replayed call that no earlier attempt recorded for the rollout (``missing``) leaves the manifest
incomplete, and one policy applies to it everywhere, fail closed (:data:`MISSING_REPLAYED_CALL`):
finalize masks the rollout with that reason, the lineage suite counts it (``replayed`` vs
``replayed_found``), and recovery adopts the receipt as it is (a receipt is final) with the calls
that were found. Recovery, finalize and the lineage suite all call :func:`rollout_manifests`.

Calls are found by ``(rollout_id, call_id)``; where a key repeats (a corrupt ledger, which the
lineage suite's ``call_ids_unique`` reports), the first row in ledger order is the one found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.records.ledger import Receipt

MISSING_REPLAYED_CALL = "missing_replayed_call"  # a replayed call no earlier attempt recorded: fail closed


@dataclass(frozen=True)
class RolloutManifests:
    """Per receipt (in the order given): its manifest as rows of the calls table, and its replayed calls' count.

    Receipt ``i``'s manifest is ``rows[starts[i]:starts[i + 1]]``: the replayed calls that were
    found (in replay order), then its own attempt's calls (in ledger order). ``replayed[i]`` calls
    were named, ``replayed_found[i]`` of them found; the manifest is complete when the two agree.
    """

    rows: np.ndarray
    starts: np.ndarray
    replayed: np.ndarray
    replayed_found: np.ndarray
    replayed_rows: np.ndarray  # the found replayed calls' rows, receipt after receipt
    replayed_owner: np.ndarray  # the receipt of each of them

    def of(self, receipt: int) -> np.ndarray:
        return self.rows[self.starts[receipt] : self.starts[receipt + 1]]

    def complete(self, receipt: int) -> bool:
        return bool(self.replayed[receipt] == self.replayed_found[receipt])

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.starts)


def rollout_manifests(calls: pa.Table, call_attempts: np.ndarray, receipts: pa.Table) -> RolloutManifests:
    """The manifest of each receipt of ``receipts`` (columns ``rollout_id``, ``attempt``, ``replayed_calls``) over
    the call records ``calls`` (``rollout_id``, ``call_id``), whose file's attempt is ``call_attempts``."""
    count = receipts.num_rows
    own, own_starts = own_rows(calls, call_attempts, receipts)
    lists = receipts.column("replayed_calls").combine_chunks()
    named_owner = np.asarray(pc.list_parent_indices(lists).to_numpy(), np.int64)
    rollout = pc.take(receipts.column("rollout_id"), pa.array(named_owner, pa.int64()))
    row = pc.index_in(
        pc.binary_join_element_wise(rollout, pc.list_flatten(lists), "/"),
        value_set=pc.binary_join_element_wise(calls.column("rollout_id"), calls.column("call_id"), "/"),
    )
    row = np.asarray(pc.fill_null(row, -1).to_numpy(zero_copy_only=False), np.int64)
    receipt_attempts = np.asarray(receipts.column("attempt").to_numpy(), np.int64)
    earlier = np.zeros(row.size, bool)
    earlier[row >= 0] = call_attempts[row[row >= 0]] < receipt_attempts[named_owner[row >= 0]]
    found_rows, found_owner = row[earlier], named_owner[earlier]  # grouped by receipt, in replay order
    found = np.bincount(found_owner, minlength=count)
    own_owner = np.repeat(np.arange(count, dtype=np.int64), np.diff(own_starts))
    owner = np.concatenate([found_owner, own_owner])
    order = np.lexsort((np.arange(owner.size), np.repeat([0, 1], [found_rows.size, own.size]), owner))
    return RolloutManifests(
        rows=np.concatenate([found_rows, own]).astype(np.int64)[order],
        starts=_offsets(found + np.diff(own_starts)),
        replayed=np.bincount(named_owner, minlength=count),
        replayed_found=found,
        replayed_rows=found_rows,
        replayed_owner=found_owner,
    )


def own_rows(table: pa.Table, attempts: np.ndarray, receipts: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``table`` (calls or failure rows) per receipt: its rollout's, in its attempt, in ledger order.

    Returns the rows, receipt after receipt, and each receipt's start in them (plus the total).
    """
    owner = pc.fill_null(pc.index_in(table.column("rollout_id"), value_set=receipts.column("rollout_id")), -1)
    owner = np.asarray(owner.to_numpy(zero_copy_only=False), np.int64)
    kept = np.flatnonzero(owner >= 0)
    receipt_attempts = np.asarray(receipts.column("attempt").to_numpy(), np.int64)
    kept = kept[attempts[kept] == receipt_attempts[owner[kept]]]
    kept = kept[np.argsort(owner[kept], kind="stable")]
    return kept, _offsets(np.bincount(owner[kept], minlength=receipts.num_rows))


def receipts_table(receipts: Sequence[Receipt]) -> pa.Table:
    """The receipts as the table :func:`rollout_manifests` reads."""
    return Receipt.to_table(list(receipts))


def _offsets(sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Start offsets of consecutive runs of ``sizes`` (plus the total): ``[0, s0, s0+s1, ...]``."""
    return np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))]).astype(np.int64)
