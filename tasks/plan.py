"""The plan stage: expand a batch config into rollouts and shards (ARCHITECTURE sections 1, 3, 12).

Rollouts are tasks × group size with deterministic ids and seeds. Groups are split into
contiguous task ranges per shard, so a group never spans shards and advantages can be computed
shard by shard. The batch config and every shard's plan are written once: planning the same
batch again with the same config is a no-op, with a different one an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from tasks import ids
from tasks.capture.records import canonical_json
from tasks.config import BatchConfig, ConfigError
from tasks.environments.registry import load_environment
from tasks.schema import ArrowRecord, column, read_parquet_bytes
from tasks.storage import layout
from tasks.storage.objects import ObjectConflictError, ObjectStore
from tasks.storage.options import StorageOptions


@dataclass(frozen=True, eq=False)
class PlannedRollout(ArrowRecord):
    """One rollout of the plan: which task, which sample of its group, and its seed."""

    rollout_id: str = column(pa.string())
    group_id: str = column(pa.string())
    task_index: int = column(pa.int64())
    sample_index: int = column(pa.int32())
    seed: int = column(pa.int64())
    task_json: str = column(pa.string())


@dataclass(frozen=True)
class PlanSummary:
    batch_id: str
    batch_url: str
    rollouts: int
    shards: tuple[int, ...]
    created: bool


def batch_store(root_url: str, batch_id: str, storage_options: StorageOptions | None = None) -> ObjectStore:
    """The object store rooted at a batch's directory under ``root_url`` (fsspec ``storage_options``)."""
    return ObjectStore(root_url, **dict(storage_options or {})).child(layout.batch_dir(batch_id))


def shard_task_range(config: BatchConfig, shard: int) -> range:
    """Task indices of ``shard``: contiguous, balanced, covering every task exactly once."""
    if not 0 <= shard < config.shards:
        raise ConfigError(f"shard {shard} is out of range: the batch has {config.shards} shards")
    return range(shard * config.num_tasks // config.shards, (shard + 1) * config.num_tasks // config.shards)


def plan_rollouts(config: BatchConfig, tasks: list[dict], shard: int) -> list[PlannedRollout]:
    return [
        PlannedRollout(
            rollout_id=ids.rollout_id(task_index, sample),
            group_id=ids.group_id(task_index),
            task_index=task_index,
            sample_index=sample,
            seed=ids.derive_seed(config.seed, "rollout", task_index, sample),
            task_json=canonical_json(tasks[task_index]),
        )
        for task_index in shard_task_range(config, shard)
        for sample in range(config.group_size)
    ]


def plan_batch(root_url: str, config: BatchConfig) -> PlanSummary:
    """Write ``plan/batch.json`` and every ``plan/shard-K.parquet`` for ``config``."""
    store = batch_store(root_url, config.batch_id)
    environment = load_environment(config.environment, config.environment_options)
    tasks = environment.make_tasks(config.num_tasks, config.seed)
    if len(tasks) != config.num_tasks:
        raise ConfigError(f"environment {config.environment!r} made {len(tasks)} tasks, {config.num_tasks} were asked")
    try:
        written = store.write_once(layout.plan_config(), config.to_json().encode("utf-8"))
    except ObjectConflictError:
        raise ConfigError(
            f"batch {config.batch_id} was already planned at {store.url} with a different config; choose a new batch id"
        ) from None
    for shard in range(config.shards):
        table = PlannedRollout.to_table(plan_rollouts(config, tasks, shard))
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        store.write_once(layout.plan_shard(shard), sink.getvalue().to_pybytes())
    return PlanSummary(
        batch_id=config.batch_id,
        batch_url=store.url,
        rollouts=config.num_rollouts,
        shards=tuple(range(config.shards)),
        created=written.created,
    )


def read_batch_config(store: ObjectStore) -> BatchConfig:
    """The batch config of the batch ``store`` is rooted at; a clear error when it was never planned."""
    path = layout.plan_config()
    if not store.exists(path):
        raise ConfigError(f"{store.url}/{path} does not exist: run `rollout-ledger plan` for this batch first")
    return BatchConfig.from_json(store.read_bytes(path), source=f"{store.url}/{path}")


def read_shard_plan(store: ObjectStore, config: BatchConfig, shard: int) -> list[PlannedRollout]:
    """The planned rollouts of ``shard``, validated against the record schema."""
    shard_task_range(config, shard)
    path = layout.plan_shard(shard)
    if not store.exists(path):
        raise FileNotFoundError(f"{store.url}/{path} does not exist: the plan of shard {shard} is missing")
    table = read_parquet_bytes(store.read_bytes(path))
    return PlannedRollout.from_table(table, source=f"{store.url}/{path}")
