"""The finalize stage: committed shards in, a staged GRPO dataset out (docs/architecture.md §8).

Shard by shard (bounded memory): verify and linearize every receipt (:mod:`tasks.finalize.verify`),
assemble the planned groups with their advantages (:mod:`tasks.finalize.assemble`), and stream
the rows into the dataset's parts (:mod:`tasks.finalize.dataset_writer`). The optional logprob audit
(:mod:`tasks.finalize.logprob_audit`, imported only when it runs: it needs torch) recomputes the
sampled tokens' logprobs of a seeded sample of trainable rows with the HF model.

Preconditions: every planned shard is committed, or ``allow_partial`` finalizes the committed
ones and the dataset says which are missing (its manifest, metrics and card); a batch without
any committed shard is refused either way. The staged manifest ``dataset/_STAGED.json`` is
written last; a batch whose staged manifest exists is not finalized again. Consumers trust only
``dataset/_COMMITTED.json``, which :mod:`tasks.publish` writes once both validation suites pass.
"""

from __future__ import annotations

import functools
import logging
import random
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.errors import NoCommittedShardsError, UncommittedShardsError
from tasks.finalize.assemble import AssembledRows, assemble_rows
from tasks.finalize.dataset_writer import StagedDataset, stage_dataset
from tasks.finalize.metrics import DatasetMetrics
from tasks.finalize.verify.shard import prepare_shard
from tasks.finalize.weights import BatchWeights
from tasks.records.dataset_row import DatasetRow

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
AUDIT_CANDIDATES = 512  # trainable rows kept (reservoir) for the audit to sample from
READ_AHEAD = 2  # shards read and converted in background threads while one is verified
AUDIT_SAMPLE_SIZE = 32


@dataclass(frozen=True)
class FinalizeOptions:
    """Later-stage overrides (only what is safe to change after planning) and the audit switch."""

    on_invalid: str | None = None
    advantage: str | None = None
    allow_partial: bool = False
    audit: bool | None = None  # None: on for the bundled model, off otherwise
    audit_sample_size: int = AUDIT_SAMPLE_SIZE


def finalize_batch(batch: Batch, options: FinalizeOptions | None = None) -> StagedDataset:
    """Verify and linearize ``batch`` into its staged dataset; a no-op when it is already staged.

    The dataset is not trusted by consumers until both validation suites pass and
    :func:`tasks.publish.publish_batch` commits it.

    Raises :class:`UncommittedShardsError` naming the uncommitted shards unless
    ``options.allow_partial``, and :class:`NoCommittedShardsError` when no shard is committed.
    """
    options = options or FinalizeOptions()
    store, batch_id = batch.store, batch.batch_id
    config = batch.config
    overrides = {k: v for k, v in (("on_invalid", options.on_invalid), ("advantage", options.advantage)) if v}
    config = config.with_overrides(**overrides) if overrides else config
    existing = batch.staged_dataset()
    if existing is not None:
        log.info("batch %s is already finalized: nothing to do", batch_id)
        if existing.partial:
            log.warning("batch %s was finalized without shard(s) %s", batch_id, list(existing.missing_shards))
        return StagedDataset(url=store.url, marker=existing, created=False)
    committed = [shard for shard in range(config.shards) if batch.shard_marker(shard) is not None]
    missing = sorted(set(range(config.shards)) - set(committed))
    _check_committed(batch_id, config.shards, missing, allow_partial=options.allow_partial)
    metrics = DatasetMetrics(weights=BatchWeights.of_plan(config))
    audit_on = options.audit if options.audit is not None else _is_bundled(config)
    sample = _Reservoir(AUDIT_CANDIDATES, seed=config.seed) if audit_on else None
    assembled = _assembled_shards(batch, config, committed, metrics, sample)

    def audit() -> dict[str, Any] | None:
        if sample is None or not sample.items:
            return None
        from tasks.finalize.logprob_audit import audit_logprobs
        from tasks.finalize.off_policy import OffPolicyThresholds
        from tasks.models.reference import resolve_model_reference

        report = audit_logprobs(
            sample.items,
            model_path=str(resolve_model_reference(config.model.reference)),
            sampling=config.sampling,
            sample_size=min(options.audit_sample_size, len(sample.items)),
            seed=config.seed,
            planned_weight_version=config.weight_version,
            thresholds=OffPolicyThresholds.of(config.validation),
        )
        return report.to_dict()

    return stage_dataset(store, assembled, config=config, metrics=metrics, audit=audit, missing_shards=missing)


def _check_committed(batch_id: str, shards: int, missing: list[int], *, allow_partial: bool) -> None:
    """Refuse a batch with uncommitted shards (unless ``allow_partial``) or without any committed shard."""
    if len(missing) == shards:
        raise NoCommittedShardsError(
            f"batch {batch_id}: none of its {shards} shard(s) has a commit marker, so there is nothing to "
            f"finalize (--allow-partial needs at least one); run `rollout-ledger generate --root ROOT --batch-id "
            f"{batch_id} --shard N` for its shards first"
        )
    if missing and not allow_partial:
        raise UncommittedShardsError(
            f"batch {batch_id}: shard(s) {missing} of {shards} have no commit marker; generate them first, "
            "or pass --allow-partial to finalize only the committed shards (the dataset then records them as missing)"
        )
    if missing:
        log.warning("finalizing batch %s without uncommitted shard(s) %s (--allow-partial)", batch_id, missing)


def _assembled_shards(
    batch: Batch, config: BatchConfig, shards: list[int], metrics: DatasetMetrics, sample: _Reservoir | None
) -> Iterator[AssembledRows]:
    """The rows of every planned group of the committed shards, a shard at a time, groups ascending.

    While a shard is verified, the next ``READ_AHEAD`` are read and converted (:func:`prepare_shard`:
    mostly Arrow and numpy work, outside the GIL) in background threads, so at most
    ``READ_AHEAD + 1`` shards are held.
    """
    for prepared in _read_ahead(functools.partial(prepare_shard, batch, config=config), shards):
        tables = prepared.tables
        if tables is None:  # verification rejects every rollout of the shard with the ledger's reason
            log.warning("shard %d: the committed ledger cannot be trusted: %s", prepared.shard, prepared.read)
        else:
            metrics.add_ledger(
                calls=tables.calls.num_rows,
                token_in_calls=int(pc.sum(pc.equal(tables.calls.column("mode"), "token_in"), min_count=0).as_py()),
                failure_reasons=Counter(tables.failures.column("reason").to_pylist()),
            )
            metrics.weights.add_staged(prepared.staged_rows)
        # One verdict per planned rollout, under its planned group (missing receipts included),
        # so the plan's groups are read off the verdicts.
        verified = prepared.verify()
        planned: dict[str, list[str]] = {}
        for group_id, rollout_id in zip(verified.group_ids, verified.rollout_ids, strict=True):
            planned.setdefault(group_id, []).append(rollout_id)
        rows = assemble_rows(
            verified,
            batch_id=config.batch_id,
            planned=planned,
            weights=metrics.weights.plan,
            on_invalid=config.on_invalid,
            advantage=config.advantage,
        )
        if sample is not None:
            sample.offer_trainable(rows.table)
        log.info("shard %d: %d planned rollouts verified, %d groups", prepared.shard, len(verified), len(planned))
        yield rows


def _read_ahead(read: Callable[[T], R], items: Sequence[T], depth: int = READ_AHEAD) -> Iterator[R]:
    """``read(item)`` of each item in order, ``depth`` background threads reading up to ``depth`` items ahead."""
    with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="finalize-read") as pool:
        pending = deque(pool.submit(read, item) for item in items[:depth])
        for following in items[depth:]:
            ready = pending.popleft().result()
            pending.append(pool.submit(read, following))
            yield ready
        while pending:
            yield pending.popleft().result()


def _is_bundled(config: BatchConfig) -> bool:
    from tasks.models.reference import is_bundled

    return is_bundled(config.model.reference)


class _Reservoir:
    """A uniform, seeded sample of at most ``size`` trainable rows from a stream (bounded memory).

    Rows are offered table by table; only the rows the sample keeps are built as records.
    """

    def __init__(self, size: int, *, seed: int) -> None:
        self.size = size
        self.items: list[DatasetRow] = []
        self.seen = 0
        self._rng = random.Random(seed)

    def offer_trainable(self, table: pa.Table) -> None:
        """Offer every trainable row of a :class:`DatasetRow` table, in order."""
        trainable = np.flatnonzero(table.column("sample_mask").to_numpy() == 1)
        for index in trainable.tolist():
            self.seen += 1
            slot = len(self.items) if len(self.items) < self.size else self._rng.randrange(self.seen)
            if slot < self.size:
                (row,) = DatasetRow.from_table(table.slice(index, 1))
                if slot == len(self.items):
                    self.items.append(row)
                else:
                    self.items[slot] = row
