"""Verify and linearize every planned rollout of a committed shard (docs/architecture.md §8).

Fail-closed rule: a rollout is trainable only when every link of its chain root→terminal is
proven against the committed bytes; anything else gets a stable reason from
:mod:`tasks.finalize.reasons`, never an exception. One bad rollout, one bad row, or one bad
segment never stops the others: a segment that fails its checksum rejects only the rollouts
whose chains read it.

Order of the checks (the first failing one names the reason): receipt guards
(:mod:`~tasks.finalize.verify.guards`), manifest guards (duplicates), terminal re-attribution and
the chain's graph in the manifest (:mod:`~tasks.finalize.verify.chains`), fetch
(:mod:`~tasks.finalize.verify.fetch`), versions, every compared field of the staged row against
its call record and the batch config, malformed rows, the recomputed digest, extras, parent
lengths, the chain-hash walk, mask order, non-empty generation, the sampling masks (present when the
batch's sampling truncates, well-formed, the ones the extras name), the terminal's cumulative hash
(:mod:`~tasks.finalize.verify.staged_rows`).

A shard is verified in two steps: :func:`prepare_shard` reads and converts (ledger tables,
chains, the staged rows of every chain in one table, their token lists flattened: mostly Arrow
and numpy work, which finalization runs for the next shards in background threads), then
:meth:`PreparedShard.verify` checks, hashes and combines the verdicts per rollout. Nothing is
built per call: the verdicts come back as columns (:class:`~tasks.finalize.verify.verdicts.VerifiedRollouts`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from tasks.batch import Batch
from tasks.capture.graph import INDEPENDENT
from tasks.config import BatchConfig
from tasks.errors import StorageIntegrityError, UncommittedShardError
from tasks.finalize import reasons as r
from tasks.finalize.ragged import gather, owners, take_rows
from tasks.finalize.verify.chains import ShardChains, shard_chains
from tasks.finalize.verify.fetch import fetch_chains
from tasks.finalize.verify.guards import rollout_verdict
from tasks.finalize.verify.staged_rows import ChainRows
from tasks.finalize.verify.verdicts import Linearized, VerdictsBuilder, VerifiedRollouts
from tasks.records.ledger import Receipt
from tasks.records.planned import PlannedRollout
from tasks.storage.ledger_reader import LedgerTables
from tasks.storage.staged_reader import StagedReader

log = logging.getLogger(__name__)


def prepare_shard(batch: Batch, shard: int, config: BatchConfig) -> PreparedShard:
    """Read and convert everything the verification of ``shard`` needs; :meth:`PreparedShard.verify` checks it.

    ``config`` is the batch's, with finalize's overrides. Raises :class:`UncommittedShardError` when the
    shard has no marker (a precondition of finalization, not a property of one rollout); a
    ledger that fails its integrity checks rejects every planned rollout with that reason.
    """
    plan = batch.shard_plan(shard)
    try:
        ledger = batch.ledger(shard)
    except UncommittedShardError:
        raise
    except StorageIntegrityError as exc:
        return PreparedShard(config=config, shard=shard, plan=plan, read=exc)
    reader = StagedReader(batch.store, segment_sha256=ledger.segment_sha256, cached_segments=0)
    return prepare_ledger(config, shard, plan, ledger.tables, ledger_batch_id=ledger.marker.batch_id, reader=reader)


def prepare_ledger(
    config: BatchConfig,
    shard: int,
    plan: Sequence[PlannedRollout],
    tables: LedgerTables,
    *,
    ledger_batch_id: str,
    reader: StagedReader,
) -> PreparedShard:
    """:func:`prepare_shard` from a committed shard's checked ledger tables, as :class:`LedgerReader` gives them.

    ``ledger_batch_id`` is the batch the shard marker commits; ``reader`` reads the staging
    segments the marker names. The staged rows of all chains are fetched in bulk: each segment
    is read once.
    """
    receipts = Receipt.from_checked_table(tables.receipts)
    chains = shard_chains(tables, receipts, independent=config.message_graph == INDEPENDENT)
    calls = take_rows(tables.calls, chains.rows)
    fetched = fetch_chains(reader, calls, chains.starts)
    picked, picked_starts = gather(chains.starts, fetched.fetched)
    chain_receipt = owners(chains.receipt_starts)
    unfetched: dict[int, str] = {}
    for k in sorted(fetched.failed):  # a receipt's first chain that cannot be read names its reason
        unfetched.setdefault(int(chain_receipt[k]), fetched.failed[k])
    read = _LedgerRead(
        tables=tables,
        receipts=receipts,
        batch_id=ledger_batch_id,
        chains=chains,
        unfetched=unfetched,
        fetched=fetched.fetched,
        staged=ChainRows.of(take_rows(calls, picked), fetched.table, np.diff(picked_starts)),
    )
    return PreparedShard(config=config, shard=shard, plan=plan, read=read)


def _combined(verdicts: list[int | str]) -> int | str:
    """A rollout's chains' verdicts as one: the first reason, else its first linearized chain.

    Chains of one rollout are verified in order, so when all pass they are linearized
    consecutively. No chain at all (its manifest gave none) reads as ``missing_staging_row``.
    """
    if not verdicts:
        return r.MISSING_STAGING_ROW
    reasons = [v for v in verdicts if isinstance(v, str)]
    if reasons:
        return reasons[0]
    if verdicts != list(range(verdicts[0], verdicts[0] + len(verdicts))):
        raise AssertionError(f"a rollout's chains were linearized out of order: {verdicts}")
    return verdicts[0]


@dataclass(frozen=True)
class _LedgerRead:
    """What a trustworthy ledger gives: its tables and receipts, every receipt's chain and the chains' staged rows.

    ``batch_id`` is the batch the shard marker commits; ``unfetched`` maps a receipt (by index)
    to the storage reason its chains' rows cannot be read; ``staged`` holds the rows of the
    ``fetched`` chains (indices into ``chains``), in that order.
    """

    tables: LedgerTables
    receipts: Sequence[Receipt]
    batch_id: str
    chains: ShardChains
    unfetched: dict[int, str]
    fetched: np.ndarray
    staged: ChainRows


@dataclass(frozen=True)
class PreparedShard:
    """A shard read for verification (:func:`prepare_shard`): its ledger's rows, or why the ledger cannot be trusted."""

    config: BatchConfig
    shard: int
    plan: Sequence[PlannedRollout]
    read: _LedgerRead | StorageIntegrityError

    @property
    def tables(self) -> LedgerTables | None:
        """The shard's ledger tables; None when the ledger cannot be trusted (:attr:`read` is the error)."""
        return None if isinstance(self.read, StorageIntegrityError) else self.read.tables

    @property
    def staged_rows(self) -> pa.Table | None:
        """The staged rows of every receipt's chain that was read (the calls behind the rows); None as in
        :attr:`tables`."""
        return None if isinstance(self.read, StorageIntegrityError) else self.read.staged.table

    def verify(self) -> VerifiedRollouts:
        """The verdict of every planned rollout, in plan order, as columns.

        A planned rollout without a receipt is ``missing_receipt``; a receipt of another group
        is ``invalid_receipt`` (reported under the planned group); receipts of unplanned
        rollouts are logged and never returned. An untrusted ledger rejects every planned
        rollout with its reason.
        """
        read, config, results = self.read, self.config, VerdictsBuilder(self.config.batch_id, self.config.sampling)
        if isinstance(read, StorageIntegrityError):
            for planned in self.plan:
                results.add(planned.group_id, planned.rollout_id, None, read.reason, None)
            return results.build(Linearized.empty())
        chains, receipts = read.chains, read.receipts
        verdicts = read.staged.verify(config)
        chain_verdicts = dict(zip(read.fetched.tolist(), verdicts.verdicts, strict=True))
        index = {receipt.rollout_id: i for i, receipt in enumerate(receipts)}
        call_ids = read.tables.calls.column("call_id")
        shard_reason = None if read.batch_id == config.batch_id else r.wrong("batch_id")
        for planned in self.plan:
            i = index.get(planned.rollout_id)
            if i is None:
                results.add(planned.group_id, planned.rollout_id, None, r.MISSING_RECEIPT, None)
                continue
            receipt = receipts[i]
            own = range(int(chains.receipt_starts[i]), int(chains.receipt_starts[i + 1]))
            staged = read.unfetched.get(i) or _combined([chain_verdicts[k] for k in own])

            def chain_call_ids(i: int = i) -> set[str]:
                return set(call_ids.take(pa.array(chains.receipt_rows(i))).to_pylist())

            reason, chain = rollout_verdict(
                receipt,
                chains.manifest_sizes[i],
                chains.reasons[i],
                chains.failures[i],
                chain_call_ids,
                staged,
            )
            group_id = receipt.group_id
            guard = shard_reason or (r.INVALID_RECEIPT if group_id != planned.group_id else None)
            if guard is not None:
                group_id, reason = planned.group_id, guard
            count = len(own) if chain >= 0 else 0
            epoch_spans = int(verdicts.epoch_span_counts[chain : chain + count].sum())
            selection = receipt.terminal_selection
            results.add(group_id, receipt.rollout_id, receipt.reward, reason, selection, chain, count, epoch_spans)
        unplanned = sorted(set(index) - {planned.rollout_id for planned in self.plan})
        if unplanned:
            log.warning("shard %d commits receipts of unplanned rollouts, not verified: %s", self.shard, unplanned[:10])
        return results.build(verdicts.linearized)
