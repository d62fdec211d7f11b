"""The batch form: every field a user sets to plan a batch, as JSON Schema, and the config it yields.

One definition serves the Airflow trigger form (``dags/rollout_batch.py`` wraps each field in a
``Param``), the periodic profiles (``dags/profiles.yaml`` overrides field defaults) and
``rollout-ledger demo``. :data:`RUN_FIELDS` are about the run, not the batch: they never reach the
batch config. The defaults are the embedded demo batch: the bundled SmolLM2 on vLLM,
32 rollouts in 2 shards, a few minutes on 2 CPU cores. The schema bounds mirror what
:class:`tasks.config.BatchConfig` accepts; the config stays the authority (plan refuses what it
refuses, naming the field). No Airflow import here: the CLI uses it too.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from tasks.config import ADVANTAGES, ON_INVALID, BatchConfig, ValidationSpec
from tasks.environments.registry import BUILTIN_ENVIRONMENTS
from tasks.errors import ConfigError
from tasks.ids import ID_PATTERN, MAX_ID_LENGTH
from tasks.models.reference import BUNDLED_REFERENCE

ENGINE_LABELS = {"vllm": "vLLM", "megatron": "Megatron-core (GPU workers)"}
ON_INVALID_LABELS = {"mask": "mask: keep as a masked row", "drop": "drop: leave the row out"}
ADVANTAGE_LABELS = {
    "grpo": "GRPO: (r - mean) / std",
    "dr_grpo": "Dr. GRPO: r - mean",
    "rloo": "RLOO: r - mean of the others",
}
STORAGE_URL_VARIABLE = "ROLLOUT_LEDGER_STORAGE_URL"
REQUIRED_FIELDS = ("environment", "num_tasks", "group_size", "shards", "model")
SECTIONS = (
    "Batch",
    "Environment",
    "Model and engine",
    "Sampling",
    "Dataset",
    "Storage",
    "Validation thresholds",
    "Review",
)
RUN_FIELDS = ("batch_id", "require_review", "review_timeout_hours")
DEFAULT_REVIEW_TIMEOUT_HOURS, MAX_REVIEW_TIMEOUT_HOURS = 24, 30 * 24


def default_storage_url(environ: Mapping[str, str] = os.environ) -> str:
    """``$ROLLOUT_LEDGER_STORAGE_URL``, else ``file://$AIRFLOW_HOME/rollout-ledger`` (``~/airflow`` by default)."""
    if environ.get(STORAGE_URL_VARIABLE):
        return environ[STORAGE_URL_VARIABLE]
    home = environ.get("AIRFLOW_HOME") or os.path.expanduser("~/airflow")
    return f"file://{os.path.abspath(home)}/rollout-ledger"


def _field(default: Any, section: str, title: str, description: str, **schema: Any) -> dict[str, Any]:
    return {"default": default, "section": section, "title": title, "description": description, **schema}


def _integer(default: int, section: str, title: str, description: str, **bounds: int) -> dict[str, Any]:
    return _field(default, section, title, description, type="integer", **bounds)


def _validation_fields() -> dict[str, dict[str, Any]]:
    defaults = ValidationSpec()
    descriptions = {
        "max_invalid_row_rate": "dataset suite: masked or dropped rollouts / planned rollouts, at most",
        "max_capture_poisoned_rate": "lineage suite: capture-poisoned rollouts / planned rollouts, at most",
        "max_poisoned_rate": "lineage suite: poisoned or failed receipts / receipts, at most",
        "max_failure_row_rate": "lineage suite: failure rows / model calls, at most",
        "min_declared_terminal_rate": "lineage suite: receipts with a declared terminal call / ok receipts, at least",
        "max_group_advantage_mean": "dataset suite: |mean advantage| of a group, at most",
        "reward_min": "dataset suite: rewards below are flagged (empty: no bound)",
        "reward_max": "dataset suite: rewards above are flagged (empty: no bound)",
    }
    fields: dict[str, dict[str, Any]] = {}
    for spec in dataclasses.fields(ValidationSpec):
        title = spec.name.replace("_", " ").capitalize()
        default = getattr(defaults, spec.name)
        if spec.name.startswith("reward_"):
            schema: dict[str, Any] = {"type": ["null", "number"]}
        elif spec.name == "max_group_advantage_mean":
            schema = {"type": "number", "minimum": 0}
        else:
            schema = {"type": "number", "minimum": 0, "maximum": 1}
        fields[spec.name] = _field(default, "Validation thresholds", title, descriptions[spec.name], **schema)
    return fields


def form_fields(environ: Mapping[str, str] = os.environ) -> dict[str, dict[str, Any]]:
    """Field name -> ``default``, ``section``, ``title``, ``description`` and the JSON Schema keywords."""
    environments = sorted(BUILTIN_ENVIRONMENTS)
    return {
        "batch_id": _field(
            None,
            "Batch",
            "Batch id",
            "empty: derived from the DAG run (stable across retries); set it to resume or re-run a planned batch",
            type=["null", "string"],
            pattern=f"^{ID_PATTERN.pattern}$",
            maxLength=MAX_ID_LENGTH,
        ),
        "num_tasks": _integer(8, "Batch", "Tasks", "tasks (GRPO groups) in the batch", minimum=1, maximum=1_000_000),
        "group_size": _integer(4, "Batch", "Group size", "rollouts per task", minimum=1, maximum=4096),
        "shards": _integer(
            2, "Batch", "Shards", "one generate task each, at most the number of tasks", minimum=1, maximum=1024
        ),
        "max_turns": _integer(5, "Batch", "Max turns", "model calls per rollout, at most", minimum=1, maximum=1024),
        "max_in_flight": _integer(
            BatchConfig.max_in_flight, "Batch", "Max in flight", "rollouts run at once per shard", minimum=1
        ),
        "seed": _integer(BatchConfig.seed, "Batch", "Seed", "batch seed: tasks and per-call sampling seeds", minimum=0),
        "environment": _field(
            "guess_number",
            "Environment",
            "Environment",
            "a built-in, a package.module:Class, or a prompt file (.parquet, .jsonl, .json) every worker can read",
            type="string",
            minLength=1,
            examples=environments,
            values_display={name: f"{name} (built-in)" for name in environments},
        ),
        "environment_options": _field(
            {"lo": 1, "hi": 10},
            "Environment",
            "Environment options",
            "options of the environment as a JSON object, e.g. guess_number's lo/hi",
            type="object",
        ),
        "model": _field(
            BUNDLED_REFERENCE,
            "Model and engine",
            "Model",
            "the bundled model, or the absolute path / file:// URI of a Hugging Face folder every worker can read",
            type="string",
            minLength=1,
            examples=[BUNDLED_REFERENCE],
            values_display={BUNDLED_REFERENCE: "SmolLM2-135M-Instruct (bundled)"},
        ),
        "engine": _field(
            "vllm",
            "Model and engine",
            "Engine",
            "inference backend",
            type="string",
            enum=list(ENGINE_LABELS),
            values_display=ENGINE_LABELS,
        ),
        "engine_options": _field(
            {"max_model_len": 2048},
            "Model and engine",
            "Engine options",
            "options of the engine as a JSON object, e.g. max_model_len, gpu_memory_utilization",
            type="object",
        ),
        "weight_version": _integer(
            BatchConfig.weight_version,
            "Model and engine",
            "Weight version",
            "the version the engine starts at (a trainer passes its policy step)",
            minimum=0,
        ),
        "temperature": _field(
            1.0, "Sampling", "Temperature", "sampling temperature", type="number", minimum=0, maximum=100
        ),
        "top_p": _field(
            1.0, "Sampling", "Top p", "nucleus sampling threshold", type="number", exclusiveMinimum=0, maximum=1
        ),
        "top_k": _integer(-1, "Sampling", "Top k", "top-k sampling; -1 turns it off", minimum=-1),
        "max_tokens": _integer(32, "Sampling", "Max tokens", "tokens per model call, at most", minimum=1),
        "on_invalid": _field(
            BatchConfig.on_invalid,
            "Dataset",
            "Invalid rollouts",
            "what the dataset does with a rollout whose lineage cannot be proven",
            type="string",
            enum=list(ON_INVALID),
            values_display=ON_INVALID_LABELS,
        ),
        "advantage": _field(
            BatchConfig.advantage,
            "Dataset",
            "Advantage estimator",
            "how group advantages are computed",
            type="string",
            enum=list(ADVANTAGES),
            values_display=ADVANTAGE_LABELS,
        ),
        "storage_url": _field(
            default_storage_url(environ),
            "Storage",
            "Storage URL",
            "where batches live: file:///path, s3://bucket/prefix or s3://conn_id@bucket/prefix",
            type="string",
            minLength=1,
        ),
        "storage_conn_id": _field(
            None,
            "Storage",
            "Storage connection",
            "Airflow connection with the storage's credentials (e.g. an AWS connection); empty: none",
            type=["null", "string"],
        ),
        **_validation_fields(),
        "require_review": _field(
            False,
            "Review",
            "Require review",
            "wait for a person's decision before publish even when both suites pass (a suite that warned always waits)",
            type="boolean",
        ),
        "review_timeout_hours": _field(
            DEFAULT_REVIEW_TIMEOUT_HOURS,
            "Review",
            "Review timeout (hours)",
            "a review nobody answers within this time rejects the batch (reason review_timeout) and fails the run",
            type="number",
            exclusiveMinimum=0,
            maximum=MAX_REVIEW_TIMEOUT_HOURS,
        ),
    }


def form_defaults(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Every field's default value."""
    return {name: spec["default"] for name, spec in form_fields(environ).items()}


def batch_config_from_form(values: Mapping[str, Any], *, batch_id: str, provenance: Mapping[str, str]) -> BatchConfig:
    """The batch config the form's ``values`` describe (a ConfigError names any bad field).

    ``provenance`` is the model's three hashes (:func:`tasks.models.provenance.model_provenance`);
    :data:`RUN_FIELDS` among ``values`` are left out.
    """
    from tasks.version import code_version

    unknown = sorted(set(values) - set(form_fields()))
    if unknown:
        raise ConfigError(f"unknown batch form field(s) {unknown}; known: {sorted(form_fields())}")
    missing = [name for name in REQUIRED_FIELDS if values.get(name) is None]
    if missing:
        raise ConfigError(f"batch form field(s) {missing} must be set")
    thresholds = {spec.name: values[spec.name] for spec in dataclasses.fields(ValidationSpec) if spec.name in values}
    raw = {
        "batch_id": batch_id,
        "environment": values["environment"],
        "environment_options": values.get("environment_options") or {},
        "num_tasks": values["num_tasks"],
        "group_size": values["group_size"],
        "shards": values["shards"],
        "seed": values.get("seed", BatchConfig.seed),
        "model": {"reference": values["model"], **provenance},
        "engine": {"name": values.get("engine", "vllm"), "options": values.get("engine_options") or {}},
        "sampling": {name: values[name] for name in ("temperature", "top_p", "top_k", "max_tokens") if name in values},
        "max_turns": values.get("max_turns", BatchConfig.max_turns),
        "max_in_flight": values.get("max_in_flight", BatchConfig.max_in_flight),
        "weight_version": values.get("weight_version", BatchConfig.weight_version),
        "on_invalid": values.get("on_invalid", BatchConfig.on_invalid),
        "advantage": values.get("advantage", BatchConfig.advantage),
        "validation": thresholds,
        "code_version": code_version(),
    }
    return BatchConfig.from_dict(raw, source="batch form")
