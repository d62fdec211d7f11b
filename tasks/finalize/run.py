"""The finalize stage: committed shards in, a published GRPO dataset out (ARCHITECTURE section 8).

Shard by shard (bounded memory): verify and linearize every receipt, assemble the planned groups
(``on_invalid``: mask keeps ``group_size`` rows per group, drop keeps valid rows only), compute
advantages, and stream the rows into the dataset's parts. The optional logprob audit recomputes
the sampled tokens' logprobs of a seeded sample of trainable rows with the HF model. The dataset
marker is written last; a batch whose marker exists is not finalized again.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tasks.config import BatchConfig, ConfigError
from tasks.finalize.audit import audit_logprobs
from tasks.finalize.dataset import DatasetRow, GroupResult, assemble_group
from tasks.finalize.metrics import DatasetMetrics
from tasks.finalize.publish import PublishedDataset, publish_dataset, read_dataset_marker
from tasks.finalize.verified import VerifiedRollout
from tasks.finalize.verify import verify_shard
from tasks.plan import batch_store, read_batch_config
from tasks.storage.errors import StorageIntegrityError
from tasks.storage.ledger import LedgerReader
from tasks.storage.marker import read_marker
from tasks.storage.objects import ObjectStore

log = logging.getLogger(__name__)
AUDIT_CANDIDATES = 512  # trainable rows kept (reservoir) for the audit to sample from
AUDIT_SAMPLE_SIZE = 32


class UncommittedShardsError(ConfigError):
    """Some planned shards have no commit marker; finalizing would silently drop their rollouts."""


@dataclass(frozen=True)
class FinalizeOptions:
    """Later-stage overrides (only what is safe to change after planning) and the audit switch."""

    on_invalid: str | None = None
    advantage: str | None = None
    allow_partial: bool = False
    audit: bool | None = None  # None: on for the bundled model, off otherwise
    audit_sample_size: int = AUDIT_SAMPLE_SIZE


def finalize_batch(root_url: str, batch_id: str, options: FinalizeOptions | None = None) -> PublishedDataset:
    """Verify, linearize and publish ``batch_id``; a no-op when its dataset is already published."""
    options = options or FinalizeOptions()
    store = batch_store(root_url, batch_id)
    config = read_batch_config(store)
    overrides = {k: v for k, v in (("on_invalid", options.on_invalid), ("advantage", options.advantage)) if v}
    config = config.with_overrides(**overrides) if overrides else config
    existing = read_dataset_marker(store)
    if existing is not None:
        log.info("batch %s is already finalized: nothing to do", batch_id)
        return PublishedDataset(url=store.url, marker=existing, created=False)
    committed = [shard for shard in range(config.shards) if read_marker(store, shard) is not None]
    missing = sorted(set(range(config.shards)) - set(committed))
    if missing and not options.allow_partial:
        raise UncommittedShardsError(
            f"batch {batch_id}: shard(s) {missing} of {config.shards} have no commit marker; generate them first, "
            "or pass --allow-partial to finalize only the committed shards"
        )
    if missing:
        log.warning("finalizing batch %s without uncommitted shard(s) %s (--allow-partial)", batch_id, missing)
    metrics = DatasetMetrics()
    sample = _Reservoir(AUDIT_CANDIDATES, seed=config.seed)
    groups = _groups(store, config, committed, metrics, sample)
    audit_on = options.audit if options.audit is not None else _is_bundled(config)

    def audit() -> dict[str, Any] | None:
        if not audit_on or not sample.items:
            return None
        report = audit_logprobs(
            sample.items,
            model_path=config.model.path,
            sampling=config.sampling,
            sample_size=min(options.audit_sample_size, len(sample.items)),
            seed=config.seed,
        )
        return report.to_dict()

    return publish_dataset(store, groups, config=config, metrics=metrics, audit=audit)


def _groups(
    store: ObjectStore, config: BatchConfig, shards: list[int], metrics: DatasetMetrics, sample: _Reservoir
) -> Iterator[GroupResult]:
    """Every planned group of the committed shards, in ascending group id, one shard in memory at a time."""
    for shard in shards:
        try:
            ledger: LedgerReader | None = LedgerReader(store, shard)
        except StorageIntegrityError as exc:  # verify_shard rejects every rollout of the shard with it
            log.warning("shard %d: the committed ledger cannot be trusted: %s", shard, exc)
            ledger = None
        else:
            metrics.add_ledger(
                calls=len(ledger.calls),
                token_in_calls=sum(c.mode == "token_in" for c in ledger.calls),
                failure_reasons=Counter(f.reason for f in ledger.failures),
            )
        # verify_shard yields exactly one result per planned rollout, under its planned group
        # (missing receipts included), so the plan's groups are read off its results.
        planned: dict[str, list[VerifiedRollout]] = {}
        for verified in verify_shard(store, shard, config, ledger=ledger):
            planned.setdefault(verified.group_id, []).append(verified)
        for group_id in sorted(planned):
            rollouts = planned[group_id]
            result = assemble_group(
                rollouts,
                batch_id=config.batch_id,
                group_id=group_id,
                planned_rollout_ids=[v.rollout_id for v in rollouts],
                on_invalid=config.on_invalid,
                advantage=config.advantage,
            )
            for row in result.rows:
                if row.sample_mask == 1:
                    sample.offer(row)
            yield result
        log.info(
            "shard %d: %d planned rollouts verified, %d groups", shard, sum(map(len, planned.values())), len(planned)
        )


def _is_bundled(config: BatchConfig) -> bool:
    from tasks.models.bundled import MODEL_NAME

    return MODEL_NAME in config.model.path


class _Reservoir:
    """A uniform, seeded sample of at most ``size`` rows from a stream (bounded memory)."""

    def __init__(self, size: int, *, seed: int) -> None:
        self.size = size
        self.items: list[DatasetRow] = []
        self.seen = 0
        self._rng = random.Random(seed)

    def offer(self, item: DatasetRow) -> None:
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(item)
        else:
            slot = self._rng.randrange(self.seen)
            if slot < self.size:
                self.items[slot] = item
