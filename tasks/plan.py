"""The plan stage: expand a batch config into rollouts and shards.

Rollouts are tasks × group size with deterministic ids and seeds. Groups are split into
contiguous task ranges per shard, so a group never spans shards and advantages can be computed
shard by shard. The batch config and every shard's plan are written once: planning the same
batch again with the same config is a no-op, with a different one an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks import ids, layout
from tasks.batch import Batch
from tasks.batch_fields import check_values
from tasks.config import BatchConfig, config_from_values
from tasks.engines.registry import check_sampling_masks, planned_weights
from tasks.environments.prompts_file import PromptsFile, is_prompt_file
from tasks.environments.registry import AnyEnvironment, Runnables, load_environment
from tasks.errors import ConfigError, ObjectConflictError, PlanConflictError
from tasks.records.ledger import canonical_json
from tasks.records.planned import PlannedRollout


@dataclass(frozen=True)
class PlanSummary:
    batch_id: str
    batch_url: str
    rollouts: int
    shards: tuple[int, ...]
    created: bool
    config: BatchConfig


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


def plan_batch(batch: Batch, config: BatchConfig, *, runnables: Runnables | None = None) -> PlanSummary:
    """Write ``plan/batch.json`` and every ``plan/shard-K.parquet`` of ``batch`` for ``config`` (of the same id).

    ``runnables`` says what the environment may be (default: the operator's). Sampling that truncates needs an
    engine that records sampling masks (:func:`~tasks.engines.registry.check_sampling_masks`). The environment is
    loaded first and the config records what it resolved to (a prompt file as a URI with its
    sha256, every option with its default filled in), so a typo or an unreadable file is refused
    before anything is written and every worker runs the same environment.
    """
    if config.batch_id != batch.batch_id:
        raise ConfigError(f"the config is of batch {config.batch_id!r}, not of {batch.batch_id!r}")
    check_sampling_masks(config.engine.name, config.sampling)
    store = batch.store
    environment = load_environment(config.environment, config.environment_options, runnables=runnables)
    config = pin_environment(config, environment)
    try:
        tasks = environment.make_tasks(config.num_tasks, config.seed)
    except ValueError as exc:
        raise ConfigError(f"environment {config.environment!r} cannot make {config.num_tasks} tasks: {exc}") from None
    if len(tasks) != config.num_tasks:
        raise ConfigError(f"environment {config.environment!r} made {len(tasks)} tasks, {config.num_tasks} were asked")
    try:
        written = store.write_once(layout.plan_config(), config.to_json().encode("utf-8"))
    except ObjectConflictError:
        differ = changed_fields(batch.config, config)
        raise PlanConflictError(
            f"batch {config.batch_id} was already planned at {store.url} with a different config "
            f"(differing: {', '.join(differ)}); plan under a new batch id"
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
        config=config,
    )


def plan_from_values(
    batch: Batch, values: Mapping[str, Any], *, source: str = "batch values", runnables: Runnables | None = None
) -> PlanSummary:
    """Plan the batch the batch fields' ``values`` describe (the rest take their defaults) in ``batch``.

    The one way from values to a planned batch, for the plan command, the DAG's plan task and the
    demo: check the values (a ConfigError names a bad field before the model is touched), resolve
    the model reference, hash the model, judge how the engine's weights are known to be it (a
    server engine asks its servers: :func:`tasks.engines.registry.planned_weights`), build the
    config (:func:`tasks.config.config_from_values`) and plan it (:func:`plan_batch`). Run and
    storage fields among ``values`` are left out. ``runnables`` says what the environment may be
    (a triggered batch: :meth:`Runnables.triggered`); a spec it refuses is named before anything else.
    """
    from tasks.models.provenance import model_provenance
    from tasks.models.reference import model_reference, resolve_model_reference

    fields = check_values(values, source=source)
    runnables = runnables or Runnables.operator()
    runnables.check_named(fields.environment)
    reference = model_reference(fields.model)
    folder = resolve_model_reference(reference)
    facts = {**model_provenance(folder), "weights": planned_weights(fields.engine, fields.engine_options, folder)}
    config = config_from_values({**values, "model": reference}, batch_id=batch.batch_id, model=facts, source=source)
    return plan_batch(batch, config, runnables=runnables)


def pin_environment(config: BatchConfig, environment: AnyEnvironment) -> BatchConfig:
    """``config`` with the environment as resolved: a prompt file by URI, options as the instance reports them."""
    by_path = isinstance(environment, PromptsFile) and is_prompt_file(config.environment)  # not a registry name
    spec = environment.options()["path"] if by_path else config.environment
    return dataclasses.replace(config, environment=spec, environment_options=environment.options())


def changed_fields(planned: BatchConfig, asked: BatchConfig) -> list[str]:
    """Dotted names of the config fields that differ (``sampling.temperature``, ``seed``, ...)."""
    return _differences(dataclasses.asdict(planned), dataclasses.asdict(asked), "")


def _differences(old: Any, new: Any, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            d
            for key in sorted(old.keys() | new.keys())
            for d in _differences(old.get(key), new.get(key), f"{prefix}{key}.")
        ]
    return [] if old == new else [prefix.rstrip(".")]
