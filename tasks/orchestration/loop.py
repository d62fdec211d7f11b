"""The training loop on Airflow assets (docs/loop.md): what its DAGs' tasks do, and what they refuse.

``grpo_dataset`` (published by a batch) drives ``grpo_train``, which takes one training step on
the published dataset(s) and announces the new checkpoint as a ``policy_checkpoint`` event;
that event (or one an external trainer posts through Airflow's REST API) drives
``policy_refit_batch``, which verifies the checkpoint, points the engine at it and runs a rollout
batch at its weight version. Every task body of those DAGs is one call of a function here.

What an event may name is not trusted (anyone allowed to post asset events can post one): a
checkpoint event names a folder, which must lie at or below the deployment's checkpoints root
(:data:`CHECKPOINTS_ROOT_VARIABLE`), and whose manifest and weights must hash as the event says
(``read_checkpoint`` hashes the folder where the engine loads it; a ``vllm_server`` refit is
verified again by the servers' own hash). A dataset event names a batch, which must lie below the
storage the trigger policy lists. Nothing an event or a run conf names runs code; the loop's
bound, ``max_steps``, is the deployment's (:data:`MAX_STEPS_VARIABLE`), never a run's.

Module level stays light (no Airflow, numpy, torch or vLLM): the DAG processor imports it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.errors import TriggerPolicyError

if TYPE_CHECKING:
    from tasks.orchestration.steps import DagRunRef
    from tasks.trigger_policy import TriggerPolicy

log = logging.getLogger("rollout_ledger.airflow")

POLICY_CHECKPOINT_ASSET = "policy_checkpoint"  # grpo_train updates it; policy_refit_batch is scheduled on it
CHECKPOINTS_ROOT_VARIABLE = "ROLLOUT_LEDGER_CHECKPOINTS_ROOT"  # the deployment's: every checkpoint lives below it
MAX_STEPS_VARIABLE = "ROLLOUT_LEDGER_MAX_STEPS"  # the deployment's: grpo_train stops announcing at this step
LOOP_BATCH_VARIABLE = "ROLLOUT_LEDGER_LOOP_BATCH"  # the deployment's: policy_refit_batch's batch fields (JSON)
DEFAULT_MAX_STEPS = 3
FROM_REST_API = "from_rest_api"  # Airflow adds it to the extra of an event posted through its REST API
EVENT_KEYS = ("weight_version", "weights_sha256", "step", "folder", "parent")
PARENT_KEYS = ("folder", "weights_sha256")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointEventError(TriggerPolicyError):
    """A ``policy_checkpoint`` event the loop refuses: malformed, a folder outside the checkpoints root, or a
    checkpoint that is not what the event says. The message names the field and the rule."""

    reason = "refused_checkpoint_event"


class LoopConfigError(TriggerPolicyError):
    """The deployment's loop settings are missing or malformed (checkpoints root, max_steps)."""

    reason = "bad_loop_settings"


@dataclass(frozen=True)
class CheckpointEvent:
    """What a ``policy_checkpoint`` event announces: a checkpoint folder, its weights' sha256, step and weight
    version, and its parent (``{"folder", "weights_sha256"}``, ``None`` for checkpoint 0)."""

    weight_version: int
    weights_sha256: str
    step: int
    folder: str
    parent: dict[str, str] | None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> CheckpointEvent:
        """Parse an event's extra strictly; a :class:`CheckpointEventError` names the first field that is wrong."""
        if not isinstance(extra, Mapping):
            raise CheckpointEventError(f"policy_checkpoint event: extra must be an object with {list(EVENT_KEYS)}")
        fields = {key: value for key, value in extra.items() if key != FROM_REST_API}
        if missing := [key for key in EVENT_KEYS if key not in fields]:
            raise CheckpointEventError(f"policy_checkpoint event: extra lacks {missing} (it needs {list(EVENT_KEYS)})")
        if unknown := sorted(set(fields) - set(EVENT_KEYS)):
            raise CheckpointEventError(f"policy_checkpoint event: unknown extra field(s) {unknown}")
        for key in ("weight_version", "step"):
            value = fields[key]
            if type(value) is not int or value < 0:
                raise CheckpointEventError(f"policy_checkpoint event: {key} must be an integer >= 0, got {value!r}")
        _check_sha("weights_sha256", fields["weights_sha256"])
        folder = fields["folder"]
        if not isinstance(folder, str) or not folder:
            raise CheckpointEventError(f"policy_checkpoint event: folder must be a path, got {folder!r}")
        parent = fields["parent"]
        if parent is not None:
            if not isinstance(parent, Mapping) or sorted(parent) != sorted(PARENT_KEYS):
                raise CheckpointEventError(
                    f"policy_checkpoint event: parent must be null or an object with {list(PARENT_KEYS)}: {parent!r}"
                )
            if not isinstance(parent["folder"], str):
                raise CheckpointEventError(f"policy_checkpoint event: parent.folder must be a path: {parent!r}")
            _check_sha("parent.weights_sha256", parent["weights_sha256"])
            parent = {"folder": parent["folder"], "weights_sha256": parent["weights_sha256"]}
        return cls(fields["weight_version"], fields["weights_sha256"], fields["step"], folder, parent)

    def to_extra(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_sha(name: str, value: Any) -> None:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise CheckpointEventError(f"policy_checkpoint event: {name} must be 64 lowercase hex digits, got {value!r}")


def checkpoints_root(environ: Mapping[str, str] = os.environ) -> Path:
    """The deployment's checkpoints root (:data:`CHECKPOINTS_ROOT_VARIABLE`): an absolute, existing folder."""
    value = environ.get(CHECKPOINTS_ROOT_VARIABLE)
    if not value:
        raise LoopConfigError(
            f"the deployment sets no checkpoints root: set {CHECKPOINTS_ROOT_VARIABLE} to the folder every "
            "checkpoint of the loop lives below (docs/loop.md)"
        )
    path = Path(value.removeprefix("file://"))
    if not path.is_absolute():
        raise LoopConfigError(f"{CHECKPOINTS_ROOT_VARIABLE}={value!r} is not an absolute path")
    return path


def max_steps(environ: Mapping[str, str] = os.environ) -> int:
    """The deployment's ``max_steps`` (:data:`MAX_STEPS_VARIABLE`, default :data:`DEFAULT_MAX_STEPS`)."""
    value = environ.get(MAX_STEPS_VARIABLE, str(DEFAULT_MAX_STEPS))
    if not value.isdigit() or int(value) < 1:
        raise LoopConfigError(f"{MAX_STEPS_VARIABLE}={value!r}: max_steps is an integer >= 1")
    return int(value)


def loop_batch_defaults(base: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """``policy_refit_batch``'s batch field defaults: ``base`` and the deployment's :data:`LOOP_BATCH_VARIABLE`
    (a JSON object of batch fields), checked by the trigger policy when the DAG file is parsed (as profiles are).
    The model and weight version are the checkpoint's, never set here."""
    import json

    from tasks.trigger_policy import load_trigger_policy

    text = environ.get(LOOP_BATCH_VARIABLE)
    try:
        given = json.loads(text) if text else {}
    except json.JSONDecodeError as error:
        raise LoopConfigError(f"{LOOP_BATCH_VARIABLE}: not JSON ({error})") from None
    if not isinstance(given, dict):
        raise LoopConfigError(f"{LOOP_BATCH_VARIABLE}: a JSON object of batch fields, got {given!r}")
    if fixed := sorted({"model", "weight_version"} & set(given)):
        raise LoopConfigError(f"{LOOP_BATCH_VARIABLE}: {fixed} come from the checkpoint, not the deployment")
    values = {**base, **given}
    load_trigger_policy(environ).check_values(values)
    return values


def checked_folder(folder: str, root: Path) -> Path:
    """``folder`` as a real path at or below ``root`` (symbolic links resolved on both); else refused, naming both."""
    given = Path(folder.removeprefix("file://"))
    if not given.is_absolute() or ".." in given.parts:
        raise CheckpointEventError(
            f"policy_checkpoint event: folder {folder!r} must be an absolute path without '..' below the "
            f"checkpoints root {root}"
        )
    real, real_root = given.resolve(), root.resolve()
    if real != real_root and real_root not in real.parents:
        raise CheckpointEventError(
            f"policy_checkpoint event: folder {folder!r} is not below the deployment's checkpoints root {root} "
            f"({CHECKPOINTS_ROOT_VARIABLE}); the loop loads no other path"
        )
    return real


def checkpoint_events(triggering_asset_events: Mapping[Any, Sequence[Any]] | None) -> list[CheckpointEvent]:
    """The ``policy_checkpoint`` events that triggered the run, parsed (a run without one is refused)."""
    extras = list(_extras(triggering_asset_events, POLICY_CHECKPOINT_ASSET))
    if not extras:
        raise CheckpointEventError(
            "this run has no policy_checkpoint event: the DAG runs when a checkpoint is announced (grpo_train, or "
            "POST /api/v2/assets/events); a run conf cannot name a checkpoint"
        )
    return [CheckpointEvent.from_extra(extra) for extra in extras]


def newest(events: Sequence[CheckpointEvent]) -> CheckpointEvent:
    """The checkpoint to sample with when several events queued up: the highest step (then weight version)."""
    chosen = max(events, key=lambda e: (e.step, e.weight_version))
    if skipped := [e for e in events if e is not chosen]:
        log.info("superseded by step %d: %s", chosen.step, ", ".join(f"step {e.step} ({e.folder})" for e in skipped))
    return chosen


def dataset_events(triggering_asset_events: Mapping[Any, Sequence[Any]] | None) -> list[Mapping[str, Any]]:
    """The ``grpo_dataset`` events' extras that triggered the run (a run without one is refused)."""
    from tasks.orchestration.steps import GRPO_DATASET_ASSET

    extras = list(_extras(triggering_asset_events, GRPO_DATASET_ASSET))
    if not extras:
        raise CheckpointEventError("this run has no grpo_dataset event: grpo_train trains on published datasets only")
    for extra in extras:
        if not isinstance(extra, Mapping) or not isinstance(extra.get("dataset"), str):
            raise CheckpointEventError(f"grpo_dataset event: extra must name the dataset, got {extra!r}")
    return extras


def _extras(triggering_asset_events: Mapping[Any, Sequence[Any]] | None, name: str) -> Iterable[Any]:
    """The extras of the events of asset ``name`` among Airflow's ``triggering_asset_events`` (keyed by asset)."""
    for asset, events in (triggering_asset_events or {}).items():
        if getattr(asset, "name", asset) == name:
            yield from (event.extra for event in events)


# --- policy_refit_batch ---------------------------------------------------------------------------------


def verify_checkpoint(triggering_asset_events: Mapping[Any, Sequence[Any]] | None) -> dict[str, Any]:
    """The ``verify_checkpoint`` task: :func:`verified_checkpoint`, a refusal failing the task without retries."""
    from tasks.orchestration import steps

    with steps._permanent("verify checkpoint", None):
        return verified_checkpoint(triggering_asset_events)


def verified_checkpoint(triggering_asset_events: Mapping[Any, Sequence[Any]] | None) -> dict[str, Any]:
    """The triggering checkpoint, verified: below the checkpoints root, its manifest and weights as the event says.

    ``read_checkpoint`` hashes the weights in the folder the engine will load; the event's sha256,
    step, weight version and parent must be the manifest's. Returns the event's extra (the folder
    resolved), which the run's other tasks take.
    """
    from tasks.trainer.checkpoint import read_checkpoint

    event = newest(checkpoint_events(triggering_asset_events))
    folder = checked_folder(event.folder, checkpoints_root())
    manifest = read_checkpoint(folder)
    found = manifest_event(manifest, folder)
    differ = [
        key
        for key in ("weights_sha256", "step", "weight_version", "parent")
        if getattr(found, key) != getattr(event, key)
    ]
    if differ:
        raise CheckpointEventError(
            f"policy_checkpoint event for {folder}: {differ} differ from its checkpoint.json "
            f"(event: {[getattr(event, k) for k in differ]}, checkpoint: {[getattr(found, k) for k in differ]})"
        )
    log.info(
        "checkpoint %s verified: step %d, weight version %d, weights sha256 %s",
        folder,
        found.step,
        found.weight_version,
        found.weights_sha256,
    )
    return found.to_extra()


def manifest_event(checkpoint: Any, folder: Path) -> CheckpointEvent:
    """The event that announces ``checkpoint`` (``read_checkpoint``'s answer, or its manifest) in ``folder``."""
    manifest = getattr(checkpoint, "manifest", checkpoint)
    parent = _get(manifest, "parent")
    if parent is not None:
        parent = {"folder": str(_get(parent, "folder")), "weights_sha256": str(_get(parent, "weights_sha256"))}
    return CheckpointEvent.from_extra(
        {
            "weight_version": int(_get(manifest, "weight_version")),
            "weights_sha256": str(_get(manifest, "weights_sha256")),
            "step": int(_get(manifest, "step")),
            "folder": str(folder),
            "parent": parent,
        }
    )


def _get(record: Any, name: str) -> Any:
    return record[name] if isinstance(record, Mapping) else getattr(record, name)


def checkpoint_policy(policy: TriggerPolicy, checkpoint: Mapping[str, Any]) -> TriggerPolicy:
    """The trigger policy with the run's verified checkpoint folder as one more model (checked below the root)."""
    folder = checked_folder(checkpoint["folder"], checkpoints_root())
    return dataclasses.replace(policy, models=(*policy.models, str(folder)))


def refit(params: Mapping[str, Any], checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """Point the run's engine at the checkpoint.

    ``vllm_server`` (servers of the run's listed connection): refit every replica to the folder at
    the checkpoint's weight version, and require every server's own hash of what it loaded to be
    the checkpoint's sha256 (servers already serving it, verified, at that version are left
    alone). The in-process engine has nothing to refit: the batch's model is the folder, which each
    generate worker hashes as it loads it.
    """
    from tasks.orchestration import steps

    servers = steps.engine_servers(params)
    if servers is None:
        log.info(
            "engine %s loads %s in each generate task: nothing to refit", params.get("engine"), checkpoint["folder"]
        )
        return {"engine": params.get("engine"), "refit": "none: the engine loads the checkpoint folder itself"}
    import asyncio

    with steps._permanent("refit", None):
        outcome = asyncio.run(_refit_servers(servers.pool, checkpoint))
    return {"engine": "vllm_server", **outcome}


async def _refit_servers(pool: Any, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    from tasks.engines.vllm_server.claims import read_claim
    from tasks.engines.vllm_server.options import REFIT_TIMEOUT_SECONDS
    from tasks.engines.vllm_server.refit import refit_urls
    from tasks.engines.vllm_server.replica import ServerReplica
    from tasks.engines.vllm_server.weights import read_records

    version, sha, folder = checkpoint["weight_version"], checkpoint["weights_sha256"], checkpoint["folder"]
    replicas = [
        ServerReplica(url, api_key=pool.api_key, key_source=pool.key_source(), timeout_s=REFIT_TIMEOUT_SECONDS)
        for url in pool.urls
    ]
    try:
        claims = [await read_claim(replica) for replica in replicas]
        records = [await read_records(replica) for replica in replicas]
    finally:
        for replica in replicas:
            await replica.close()
    if all(
        claim.weight_version == version and kept is not None and kept.sha256_of(version) == sha
        for claim, kept in zip(claims, records, strict=True)
    ):
        log.info("the servers already serve weight version %d, verified as sha256 %s: no refit", version, sha)
        return {"refit": "none: already serving it", "weight_version": version, "verified": list(pool.urls)}
    done = await refit_urls(list(pool.urls), folder, version, api_key=pool.api_key, key_source=pool.key_source())
    for verdict in done.verdicts():
        log.info("refit: %s", verdict)
    unverified = [url for url, load in done.recorded.items() if load is None or load.verified_sha256 != sha]
    if unverified or done.announced.weights_sha256 != sha:
        raise CheckpointEventError(
            f"refit to {folder} at weight version {version}: the servers' own hash of what they loaded is not the "
            f"checkpoint's sha256 {sha} on {unverified or list(pool.urls)}: {'; '.join(done.verdicts())}"
        )
    return {"refit": "refit", "weight_version": done.version, "verified": list(done.recorded)}


def batch_values(params: Mapping[str, Any], checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The batch fields of the run: the DAG's defaults with the model = the checkpoint folder, at its weight version."""
    from tasks.batch_fields import BatchFields

    values = {name: params[name] for name in BatchFields.model_fields if name in params}
    return {**values, "model": str(checkpoint["folder"]), "weight_version": int(checkpoint["weight_version"])}


def plan(params: Mapping[str, Any], run: DagRunRef, checkpoint: Mapping[str, Any]) -> list[int]:
    """Plan the run's batch at the checkpoint (``rollout_batch``'s plan step, the model being the checkpoint)."""
    from tasks.env_vars import scoped_environ
    from tasks.environments.registry import Runnables
    from tasks.lineage.datasets import plan_lineage
    from tasks.orchestration import steps
    from tasks.orchestration.lineage_report import report_lineage
    from tasks.plan import plan_from_values
    from tasks.trigger_policy import load_trigger_policy

    values = batch_values(params, checkpoint)
    with steps._permanent("plan", None):
        checkpoint_policy(load_trigger_policy(), checkpoint).check_values(values)
    batch = steps.run_batch(params, run)
    servers = steps.engine_servers(params)
    with steps._permanent("plan", batch.root_url):
        if servers is not None:
            values = servers.batch_values(values)
        with scoped_environ(**(servers.environment() if servers else {})):
            summary = plan_from_values(batch, values, source="policy checkpoint", runnables=Runnables.triggered())
    report_lineage(lambda: plan_lineage(batch))
    log.info(
        "batch %s at checkpoint step %s (weight version %s): %d rollouts in %d shards at %s",
        summary.batch_id,
        checkpoint["step"],
        checkpoint["weight_version"],
        summary.rollouts,
        len(summary.shards),
        summary.batch_url,
    )
    return list(summary.shards)


def generate(
    params: Mapping[str, Any], run: DagRunRef, shard: int, *, try_number: int, checkpoint: Mapping[str, Any]
) -> dict[str, Any]:
    """``rollout_batch``'s generate step, the worker allowing the checkpoint folder (checked below the root again)."""
    from tasks.lineage.datasets import generate_lineage
    from tasks.orchestration import steps
    from tasks.orchestration.generate_process import GenerateCommand, GenerateProcessError, run_generate
    from tasks.orchestration.lineage_report import report_lineage
    from tasks.trigger_policy import load_trigger_policy

    with steps._permanent("generate", None):
        policy = checkpoint_policy(load_trigger_policy(), checkpoint)
    servers = steps.engine_servers(params)
    command = GenerateCommand(
        steps.location(params),
        steps.run_batch_id(params, run),
        shard,
        try_number=try_number,
        secrets=servers.environment() if servers else {},
        servers=servers.pool.urls if servers else (),
        models=policy.models,
    )
    try:
        summary = run_generate(command, log=log.info)
    except GenerateProcessError as exc:
        if exc.permanent:
            steps._fail(str(exc), exc)
        raise
    report_lineage(lambda: generate_lineage(steps.run_batch(params, run), shard))
    return {
        k: summary[k] for k in ("shard", "attempt", "ok", "poisoned", "failed", "adopted", "calls", "generated_tokens")
    }


# --- grpo_train -----------------------------------------------------------------------------------------


def latest_step(root: Path) -> int | None:
    """The step of the latest ``step-NNNNNN`` checkpoint folder under ``root`` (``None``: none yet)."""
    from tasks.trainer.checkpoint import checkpoint_folders

    folders = checkpoint_folders(root)
    return int(folders[-1].name.removeprefix("step-")) if folders else None


def dataset_batches(extras: Sequence[Mapping[str, Any]]) -> tuple[list[str], str | None]:
    """The batch URLs of the published datasets the events name, each checked against the trigger policy's
    storage, and their one storage connection."""
    from tasks.trigger_policy import load_trigger_policy

    policy = load_trigger_policy()
    urls, connections = [], {extra.get("storage_conn_id") for extra in extras}
    if len(connections) > 1:
        raise CheckpointEventError(
            f"grpo_dataset events name several storage connections {sorted(map(str, connections))}"
        )
    for extra in extras:
        dataset = extra["dataset"].rstrip("/")
        if not dataset.endswith("/dataset"):
            raise CheckpointEventError(f"grpo_dataset event: {dataset!r} is not a batch's dataset folder")
        policy.check_storage(dataset, extra.get("storage_conn_id"))
        urls.append(dataset.removesuffix("/dataset"))
    return list(dict.fromkeys(urls)), connections.pop()


def train(triggering_asset_events: Mapping[Any, Sequence[Any]] | None) -> dict[str, Any]:
    """One training step on the triggering published dataset(s), unless the loop reached ``max_steps``.

    Returns ``{"trained", "announce", "checkpoint" (the new checkpoint's event extra or None),
    "step", "max_steps", "metrics", "said"}``: ``announce`` is false once the new checkpoint's step
    is ``max_steps`` (written, not announced: the loop stops), and no step is taken once the latest
    checkpoint is already there.
    """
    from tasks.orchestration import steps
    from tasks.orchestration.lineage_report import report_lineage
    from tasks.orchestration.storage_location import storage_location

    with steps._permanent("train", None):
        bound, root = max_steps(), checkpoints_root()
        batches, conn_id = dataset_batches(dataset_events(triggering_asset_events))
    latest = latest_step(root)
    if latest is not None and latest >= bound:
        said = (
            f"max_steps {bound} reached (latest checkpoint: step {latest} under {root}): no training step, no "
            f"policy_checkpoint event; datasets left untrained: {batches}"
        )
        log.warning(said)
        return {
            "trained": False,
            "announce": False,
            "checkpoint": None,
            "step": latest,
            "max_steps": bound,
            "said": said,
        }
    from tasks.trainer.checkpoint import read_checkpoint
    from tasks.trainer.step import StepSettings, train_step

    options = storage_location(batches[0], conn_id).storage_options if conn_id else {}
    with steps._permanent("train", None):
        result = train_step(root, batches, StepSettings(), storage_options=options or None)
    checkpoint = result.checkpoint
    if checkpoint is None:  # a retry after the step's checkpoint was written: announce that one
        consumed_by = {name for _, name in result.skipped}
        if len(consumed_by) != 1:
            steps._fail(f"datasets {batches} were consumed by several checkpoints {sorted(consumed_by)}: not one step")
        checkpoint = read_checkpoint(root / consumed_by.pop())
        log.info("datasets %s were consumed already, by %s: announcing it", batches, checkpoint.folder)
    else:
        report_lineage(lambda: training_lineage(result))
    event = manifest_event(checkpoint, Path(checkpoint.folder))
    announce = event.step < bound
    said = (
        f"step {event.step} trained on {batches}: checkpoint {event.folder} (weight version {event.weight_version}, "
        f"sha256 {event.weights_sha256}); "
        + (
            "announced as a policy_checkpoint event"
            if announce
            else f"max_steps {bound} reached: not announced, the loop stops"
        )
    )
    log.info(said)
    return {
        "trained": True,
        "announce": announce,
        "checkpoint": event.to_extra(),
        "step": event.step,
        "max_steps": bound,
        "metrics": _json_only(result.summary()),
        "said": said,
    }


def announce(trained: Mapping[str, Any]) -> dict[str, Any]:
    """The ``policy_checkpoint`` event's extra for a checkpoint to announce; skips the task (no event) otherwise."""
    from airflow.sdk.exceptions import AirflowSkipException

    if not trained.get("announce"):
        raise AirflowSkipException(f"no policy_checkpoint event: {trained.get('said')}")
    return CheckpointEvent.from_extra(trained["checkpoint"]).to_extra()


def _json_only(value: Any) -> Any:
    """``value`` with what JSON cannot hold (paths, numpy scalars) as text or floats: an XCom value."""
    import json

    return json.loads(json.dumps(value, default=lambda v: float(v) if hasattr(v, "__float__") else str(v)))


def training_lineage(result: Any) -> Any:
    """The step's OpenLineage datasets (``training_lineage_events``: the datasets and the parent checkpoint in, the
    new checkpoint out), reported as the task's through the provider, the way the batch tasks report theirs."""
    from tasks.lineage.datasets import TaskLineage
    from tasks.lineage.training import training_lineage_events

    complete = training_lineage_events(result.checkpoint)[-1]  # START, COMPLETE: the datasets are COMPLETE's
    return TaskLineage(inputs=tuple(complete.inputs or ()), outputs=tuple(complete.outputs or ()))
