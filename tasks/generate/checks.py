"""Everything generate checks before an engine starts, and the checked batch the later steps share.

Fail fast: the shards named, their plans (or their commit markers), the environment and its
prompt file, whether an agent command can run here (its executable, its sandbox), and, when
generate starts its own engine and has a shard to run, the model the worker resolves from the
plan's portable reference, whose hashes must equal the planned ones. An
engine passed in must serve at least the planned weight version. Each failure is a
:class:`~tasks.errors.ConfigError` (or the loader's own error) before minutes of engine start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.engines.base import Engine
from tasks.environments.agents import Agent
from tasks.environments.registry import AnyEnvironment, Runnables, load_environment
from tasks.errors import ConfigError, ModelMismatchError
from tasks.generate.progress import DEFAULT_HEARTBEAT_SECONDS
from tasks.generate.summary import ShardSummary
from tasks.models.provenance import WEIGHTS_VERIFIED
from tasks.records.planned import PlannedRollout
from tasks.storage.marker import ShardMarker
from tasks.storage.objects import ObjectStore


@dataclass
class CheckedBatch:
    """What generate checked before starting an engine: one batch, the shards still to run.

    A shard is in ``plans`` or in ``committed``, never both; ``summaries`` fills in as shards finish.
    """

    store: ObjectStore
    config: BatchConfig
    environment: AnyEnvironment
    plans: dict[int, list[PlannedRollout]]
    committed: dict[int, ShardMarker]
    model_folder: Path | None = None
    try_number: int | None = None
    capture: bool = True
    progress: bool | None = None
    progress_every_s: float = DEFAULT_HEARTBEAT_SECONDS
    summaries: dict[int, ShardSummary] = field(default_factory=dict)


def check_before_engine(
    batch: Batch, shards: Sequence[int], *, own_engine: bool, runnables: Runnables | None = None
) -> CheckedBatch:
    """Everything that can be checked without an engine; a clear error before minutes of engine start."""
    from tasks.models.reference import check_provenance, resolve_model_reference

    if not shards:
        raise ConfigError("no shard to generate: name at least one")
    if len(set(shards)) != len(shards):
        raise ConfigError(f"shards {list(shards)} name a shard twice")
    config = batch.config
    committed = {}
    plans = {}
    for shard in shards:
        marker = batch.shard_marker(shard) if 0 <= shard < config.shards else None
        if marker is not None:
            committed[shard] = marker
        else:
            plans[shard] = batch.shard_plan(shard)
    environment = load_environment(config.environment, config.environment_options, runnables=runnables)
    if plans and isinstance(environment, Agent):
        environment.check_can_run()
    work = CheckedBatch(store=batch.store, config=config, environment=environment, plans=plans, committed=committed)
    if own_engine and plans:
        folder = resolve_model_reference(config.model.reference)
        check_provenance(folder, config.model.provenance, reference=config.model.reference)
        work.model_folder = folder
    return work


def check_engine_version(engine: Engine, config: BatchConfig) -> None:
    """Refuse an engine that serves weights older than the planned version (one passed in, or a server's), or
    whose weights this worker can only take as declared when the plan verified them."""
    if engine.weight_version < config.weight_version:
        raise ConfigError(
            f"the engine serves weight version {engine.weight_version}, older than the planned "
            f"{config.weight_version}: refit it to the planned weights first"
        )
    if config.model.weights == WEIGHTS_VERIFIED and engine.weights != WEIGHTS_VERIFIED:
        raise ModelMismatchError(
            f"the plan verified the served weights by their hashes, but this worker cannot hash them "
            f"({engine.weights}): run it where the servers' model folder is readable, or plan again"
        )
