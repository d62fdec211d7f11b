"""Verify and linearize every receipt of a committed shard (ARCHITECTURE section 8).

Fail-closed rule: a rollout is trainable only when every link of its chain root→terminal is
proven against the committed bytes; anything else gets a stable reason from
:mod:`tasks.finalize.reasons`, never an exception. One bad rollout, one bad row, or one bad
segment never stops the others: a segment that fails its checksum rejects only the rollouts
whose chains read it.

Order of the checks (the first failing one names the reason): receipt guards, manifest guards
(duplicates), terminal re-attribution and the chain's graph in the manifest
(:mod:`tasks.finalize.chains`), fetch (:mod:`tasks.finalize.fetch`), versions, every compared
field of the staged row against its call record and the batch config, malformed rows, the
recomputed digest, extras, parent lengths, the chain-hash walk, mask order, non-empty
generation, the terminal's cumulative hash (:mod:`tasks.finalize.staged_rows`). Guard reasons
win over later ones, but a rollout whose chain verified keeps its linearized tokens even when a
guard rejects it.

A shard is verified in two steps: :func:`prepare_shard` reads and converts (ledger tables,
chains, the staged rows of every chain in one table, their token lists flattened: mostly Arrow
and numpy work, which finalization runs for the next shards in background threads), then
:meth:`PreparedShard.verify` checks, hashes and combines the verdicts per rollout. Nothing is
built per call: the verdicts come back as columns (:class:`~tasks.finalize.verified.VerifiedRollouts`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from tasks.capture import terminal
from tasks.capture.records import CallRecord, FailureRow, Receipt
from tasks.config import BatchConfig
from tasks.finalize import reasons as r
from tasks.finalize.chains import ShardChains, plan_chain, shard_chains
from tasks.finalize.fetch import fetch_chains
from tasks.finalize.runs import gather, take_rows
from tasks.finalize.staged_rows import ChainRows, ChainVerdicts, conform, null_rows
from tasks.finalize.verified import Linearized, VerifiedRollout, VerifiedRollouts
from tasks.plan import PlannedRollout, read_shard_plan
from tasks.storage.errors import StorageIntegrityError, UncommittedShardError
from tasks.storage.ledger import LedgerReader, RolloutBundle
from tasks.storage.objects import ObjectStore
from tasks.storage.staged_reader import StagedReader

log = logging.getLogger(__name__)

# Failure rows with this reason poison a rollout only when the failed call is on its chain.
OFF_CHAIN_TOLERATED_FAILURE = "request_finished_without_staged_coordinates"
# Poisoned receipts carrying one of these keep it; any other poisoned receipt is capture_poisoned.
RECEIPT_REASONS = frozenset((*r.TERMINAL_REASONS, r.NO_REWARD))


def verify_shard(
    store: ObjectStore, shard: int, config: BatchConfig, *, ledger: LedgerReader | None = None
) -> Iterator[VerifiedRollout]:
    """One :class:`VerifiedRollout` per planned rollout of ``shard``, in plan order: :func:`prepare_shard`."""
    yield from prepare_shard(store, shard, config, ledger=ledger).verify()


def prepare_shard(
    store: ObjectStore,
    shard: int,
    config: BatchConfig,
    *,
    ledger: LedgerReader | None = None,
    reader: StagedReader | None = None,
) -> PreparedShard:
    """Read and convert everything the verification of ``shard`` needs; :meth:`PreparedShard.verify` checks it.

    ``store`` is rooted at the batch directory. Raises :class:`UncommittedShardError` when the
    shard has no marker (a precondition of finalization, not a property of one rollout); a
    ledger that fails its integrity checks rejects every planned rollout with that reason. The
    staged rows of all chains are fetched in bulk: each segment is read once. ``ledger`` is the
    shard's reader when the caller already has one, ``reader`` a staged reader over its
    committed segments (which may hold them already).
    """
    plan = read_shard_plan(store, config, shard)
    try:
        ledger = ledger if ledger is not None else LedgerReader(store, shard)
    except UncommittedShardError:
        raise
    except StorageIntegrityError as exc:
        return PreparedShard(config=config, shard=shard, plan=plan, read=exc)
    chains = shard_chains(ledger.tables, ledger.receipts)
    chained = np.array([i for i, reason in enumerate(chains.reasons) if reason is None], np.int64)
    rows, starts = gather(chains.starts, chained)
    calls = take_rows(ledger.tables.calls, chains.rows[rows])
    reader = reader or StagedReader(store, segment_sha256=ledger.segment_sha256, cached_segments=0)
    fetched = fetch_chains(reader, calls, starts)
    picked, picked_starts = gather(starts, fetched.fetched)
    read = _LedgerRead(
        ledger=ledger,
        chains=chains,
        unfetched={int(chained[k]): reason for k, reason in fetched.failed.items()},
        fetched=chained[fetched.fetched],
        staged=ChainRows.of(take_rows(calls, picked), fetched.table, np.diff(picked_starts)),
    )
    return PreparedShard(config=config, shard=shard, plan=plan, read=read)


@dataclass(frozen=True)
class _LedgerRead:
    """What a trustworthy ledger gives: every receipt's chain and the staged rows of the chains.

    ``unfetched`` maps a receipt (by index) to the storage reason its chain's rows cannot be
    read; ``staged`` holds the rows of the ``fetched`` receipts' chains, in that order.
    """

    ledger: LedgerReader
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
    def ledger(self) -> LedgerReader | None:
        """The shard's ledger; None when it cannot be trusted (:attr:`read` is the error)."""
        return None if isinstance(self.read, StorageIntegrityError) else self.read.ledger

    def verify(self) -> VerifiedRollouts:
        """The verdict of every planned rollout, in plan order, as columns.

        A planned rollout without a receipt is ``missing_receipt``; a receipt of another group
        is ``invalid_receipt`` (reported under the planned group); receipts of unplanned
        rollouts are logged and never returned. An untrusted ledger rejects every planned
        rollout with its reason.
        """
        read, config, entries = self.read, self.config, _Entries(self.config.batch_id)
        if isinstance(read, StorageIntegrityError):
            for planned in self.plan:
                entries.add(planned.group_id, planned.rollout_id, None, read.reason, None)
            return entries.done(Linearized.empty())
        chains, receipts = read.chains, read.ledger.receipts
        verdicts = read.staged.verify(config)
        staged: dict[int, int | str] = dict(read.unfetched)
        staged.update(zip(read.fetched.tolist(), verdicts.verdicts, strict=True))
        index = {receipt.rollout_id: i for i, receipt in enumerate(receipts)}
        call_ids = read.ledger.tables.calls.column("call_id")
        shard_reason = None if read.ledger.marker.batch_id == config.batch_id else r.wrong("batch_id")
        for planned in self.plan:
            i = index.get(planned.rollout_id)
            if i is None:
                entries.add(planned.group_id, planned.rollout_id, None, r.MISSING_RECEIPT, None)
                continue
            receipt = receipts[i]

            def chain_call_ids(i: int = i) -> set[str]:
                rows = chains.rows[chains.starts[i] : chains.starts[i + 1]]
                return set(call_ids.take(pa.array(rows)).to_pylist())

            reason, chain = _verdict(
                receipt,
                chains.manifest_sizes[i],
                chains.reasons[i],
                chains.failures[i],
                chain_call_ids,
                staged.get(i, r.MISSING_STAGING_ROW),
            )
            group_id = receipt.group_id
            guard = shard_reason or (r.INVALID_RECEIPT if group_id != planned.group_id else None)
            if guard is not None:
                group_id, reason = planned.group_id, guard
            epoch_spans = int(verdicts.epoch_span_counts[chain]) if chain >= 0 else 0
            selection = receipt.terminal_selection
            entries.add(group_id, receipt.rollout_id, receipt.reward, reason, selection, chain, epoch_spans)
        unplanned = sorted(set(index) - {planned.rollout_id for planned in self.plan})
        if unplanned:
            log.warning("shard %d commits receipts of unplanned rollouts, not verified: %s", self.shard, unplanned[:10])
        return entries.done(verdicts.linearized)


class _Entries:
    """Builds :class:`VerifiedRollouts` entry by entry."""

    def __init__(self, batch_id: str) -> None:
        self.batch_id = batch_id
        self.fields: tuple[list, ...] = ([], [], [], [], [], [], [])

    def add(
        self,
        group_id: str,
        rollout_id: str,
        reward: float | None,
        reason: str | None,
        terminal_selection: str | None,
        chain: int = -1,
        epoch_spans: int = 0,
    ) -> None:
        """One rollout's verdict; ``chain`` indexes the linearized chains given to :meth:`done` (-1: none)."""
        values = (group_id, rollout_id, reward, reason, terminal_selection, chain, epoch_spans)
        for cells, value in zip(self.fields, values, strict=True):
            cells.append(value)

    def done(self, linearized: Linearized) -> VerifiedRollouts:
        group_ids, rollout_ids, rewards, reasons, selections, chains, epoch_spans = self.fields
        return VerifiedRollouts(
            batch_id=self.batch_id,
            group_ids=group_ids,
            rollout_ids=rollout_ids,
            rewards=rewards,
            reasons=reasons,
            terminal_selections=selections,
            epoch_span_counts=np.array(epoch_spans, np.int64),
            chain=np.array(chains, np.int64),
            linearized=linearized,
        )


def verify_rollout(bundle: RolloutBundle, staged_rows: pa.Table | str, config: BatchConfig) -> VerifiedRollout:
    """Verify one receipted rollout and linearize its chain; never raises for bad data.

    ``staged_rows`` are the staged rows of the chain root→terminal in that order, or the reason
    string of a failed fetch. The result has ``reason`` None exactly when the rollout is
    trainable; it keeps its tokens whenever the chain itself verified.
    """
    chain = plan_chain(bundle)
    staged: int | str = staged_rows if isinstance(staged_rows, str) else r.MISSING_STAGING_ROW
    verdicts = ChainVerdicts.of_failed([])
    if chain.reason is None and not isinstance(staged_rows, str):
        if staged_rows.num_rows != len(chain.calls):
            conformed = conform(staged_rows)
            bad = conformed is None or null_rows(conformed).any()
            staged = r.INVALID_STAGED_ROW if bad else r.MISSING_STAGING_ROW
        else:
            calls = CallRecord.to_table(chain.calls)
            verdicts = verify_chain_rows(calls, staged_rows, np.array([len(chain.calls)]), config)
            staged = verdicts.verdicts[0]
    receipt = bundle.receipt
    reason, index = _verdict(
        receipt,
        len(bundle.manifest),
        chain.reason,
        bundle.failures,
        lambda: {call.call_id for call in chain.calls},
        staged,
    )
    epoch_spans = int(verdicts.epoch_span_counts[index]) if index >= 0 else 0
    entries = _Entries(config.batch_id)
    entries.add(
        receipt.group_id, receipt.rollout_id, receipt.reward, reason, receipt.terminal_selection, index, epoch_spans
    )
    return next(iter(entries.done(verdicts.linearized)))


def _verdict(
    receipt: Receipt,
    manifest_size: int,
    chain_reason: str | None,
    failures: Sequence[FailureRow],
    chain_call_ids: Callable[[], set[str]],
    staged: int | str,
) -> tuple[str | None, int]:
    """(reason, linearized chain or -1) of a receipted rollout; guards win over the chain and its rows.

    ``staged`` is the chain's linearization index, or the reason its staged rows failed;
    ``chain_call_ids`` returns the chain's call ids (asked only when there are failure rows).
    """
    guard = _receipt_reason(receipt, manifest_size)
    if chain_reason is not None:
        return guard or chain_reason, -1
    if guard is None and failures:
        guard = _failure_reason(failures, chain_call_ids())
    if isinstance(staged, str):
        return guard or staged, -1
    return guard, staged


# --- guards -----------------------------------------------------------------------------------


def _receipt_reason(receipt: Receipt, manifest_size: int) -> str | None:
    """What the receipt alone says: inconsistent with its manifest, failed, or poisoned."""
    if receipt.num_calls != manifest_size:
        return r.INVALID_RECEIPT
    if receipt.status == "ok" and receipt.terminal_attribution_reason != terminal.SELECTED:
        return r.INVALID_RECEIPT
    if receipt.status == "failed":
        return r.ROLLOUT_FAILED
    if receipt.status == "poisoned":
        return receipt.failure_reason if receipt.failure_reason in RECEIPT_REASONS else r.CAPTURE_POISONED
    return None


def _failure_reason(failures: Sequence[FailureRow], chain_call_ids: set[str]) -> str | None:
    """Failure rows poison the rollout, except a tolerated reason on a call off the chain."""
    for failure in failures:
        if failure.reason != OFF_CHAIN_TOLERATED_FAILURE or failure.call_id in chain_call_ids:
            return r.CAPTURE_POISONED
    return None


# --- staged rows ------------------------------------------------------------------------------


def verify_chains(
    chains: Sequence[Sequence[CallRecord]], table: pa.Table, config: BatchConfig
) -> list[VerifiedRollout | str]:
    """Per chain of call records: its linearization, or the first reason its staged rows fail.

    ``table`` holds the rows of every chain, chain after chain, each root→terminal (see
    :func:`verify_chain_rows`). Identity fields of a linearized rollout are left for the caller.
    """
    calls = CallRecord.to_table([call for chain in chains for call in chain])
    verdicts = verify_chain_rows(calls, table, np.array([len(c) for c in chains], np.int64), config)
    results: list[VerifiedRollout | str] = []
    for chain, verdict in zip(chains, verdicts.verdicts, strict=True):
        if isinstance(verdict, str):
            results.append(verdict)
            continue
        terminal_call = chain[-1]
        results.append(
            VerifiedRollout(
                batch_id=terminal_call.batch_id,
                group_id="",
                rollout_id=terminal_call.rollout_id,
                reward=None,
                reason=None,
                epoch_span_count=int(verdicts.epoch_span_counts[verdict]),
                **verdicts.linearized.rollout_fields(verdict),
            )
        )
    return results


def verify_chain_rows(calls: pa.Table, table: pa.Table, lengths: np.ndarray, config: BatchConfig) -> ChainVerdicts:
    """Verify the staged rows of many chains at once: per chain, its linearization or first failing reason.

    ``calls`` (call records) and ``table`` (staged rows) hold the rows of every chain, chain
    after chain, each root→terminal; chain ``k`` has ``lengths[k]`` rows. A chain's reason is the
    earliest check that any of its rows fails, exactly as if its rows were checked alone.
    """
    return ChainRows.of(calls, table, lengths).verify(config)
