"""The batch fields: every value a user sets to plan a batch, declared once.

:class:`BatchFields` declares each field's name, type, default, bounds or choices (with labels
for people), title, description and form section, and where its value lands in the batch
config (:class:`InConfig`; a field without one is about the run or its storage and never
reaches the config). Everything else is derived from it: the Airflow trigger form
(:func:`tasks.orchestration.form.form_fields`, JSON Schema from pydantic), the
``rollout-ledger plan`` flags (:mod:`tasks.cli`), the checks of the config's fields
(:func:`check_recorded`, called by :mod:`tasks.config`) and the field table of
docs/configuration.md (:mod:`tasks.batch_fields_doc`). A new field is one attribute here plus
its test (docs/configuration.md says so too).

Importing this module is light (pydantic, :mod:`tasks.ids`, the bundled model's name; no numpy,
pyarrow, fsspec or Airflow): the DAG file imports it at parse time. It sits below the engines:
the engine field is a name here, checked against the registry with its options when the config
is built (:class:`tasks.config.EngineSpec`), and offered as a choice where the form is built.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from tasks.errors import ConfigError
from tasks.ids import ID_PATTERN, MAX_ID_LENGTH
from tasks.models.reference import BUNDLED_REFERENCE

BUNDLED_LABEL = "SmolLM2-135M-Instruct (bundled)"
ON_INVALID = ("mask", "drop")
MESSAGE_GRAPHS = ("splice", "independent")  # how agents' calls are prompted (tasks/capture/graph.py)
MESSAGE_GRAPH_LABELS = {
    "splice": "splice: a call that extends an earlier one continues its exact tokens",
    "independent": "independent: every call renders its whole history afresh",
}
RESUME_MODES = ("turn", "restart")  # how a new attempt goes on with a rollout an earlier one left unfinished
RESUME_TURN = RESUME_MODES[0]
RESUME_LABELS = {
    "turn": "turn: replay its committed calls, go on from the last",
    "restart": "restart: sample it again from its first turn",
}
ADVANTAGES = ("grpo", "dr_grpo", "rloo")
ON_INVALID_LABELS = {"mask": "mask: keep as a masked row", "drop": "drop: leave the row out"}
ADVANTAGE_LABELS = {
    "grpo": "GRPO: (r - mean) / std",
    "dr_grpo": "Dr. GRPO: r - mean",
    "rloo": "RLOO: r - mean of the others",
}
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
STORAGE_URL_VARIABLE = "ROLLOUT_LEDGER_STORAGE_URL"
MAX_REVIEW_TIMEOUT_HOURS = 30 * 24
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class InConfig:
    """Where a field's value lands in the batch config: a dotted path of :class:`tasks.config.BatchConfig`."""

    path: str


@dataclass(frozen=True)
class PlanFlag:
    """How ``rollout-ledger plan`` takes a field, when not as an optional ``--<name-with-dashes>``."""

    name: str | None = None
    required: bool = False  # the flag must be given: its default is the form's prefill, not a script's


def default_storage_url(environ: Mapping[str, str] = os.environ) -> str:
    """``$ROLLOUT_LEDGER_STORAGE_URL``, else ``file://$AIRFLOW_HOME/rollout-ledger`` (``~/airflow`` by default)."""
    if environ.get(STORAGE_URL_VARIABLE):
        return environ[STORAGE_URL_VARIABLE]
    home = environ.get("AIRFLOW_HOME") or os.path.expanduser("~/airflow")
    return f"file://{os.path.abspath(home)}/rollout-ledger"


_THRESHOLDS = {"section": "Validation thresholds"}
Rate = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]  # a share of rows: finite, in [0, 1]


class BatchFields(BaseModel):
    """One batch's values, as the trigger form, a profile or the plan flags give them (strict: no coercion).

    Attribute order is the form's order. The defaults are the embedded demo batch: the bundled
    SmolLM2 on vLLM, 32 rollouts in 2 shards, a few minutes on 2 CPU cores. The default
    ``environment_options`` and ``engine_options`` belong to the default environment and engine:
    values that name another one and no options get none.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    batch_id: str | None = Field(
        None,
        title="Batch id",
        description="empty: derived from the DAG run (stable across retries); "
        "set it to resume or re-run a planned batch",
        pattern=f"^{ID_PATTERN.pattern}$",
        max_length=MAX_ID_LENGTH,
        json_schema_extra={"section": "Batch"},
    )
    num_tasks: Annotated[int, InConfig("num_tasks"), PlanFlag(required=True)] = Field(
        8,
        ge=1,
        le=1_000_000,
        title="Tasks",
        description="tasks (GRPO groups) in the batch",
        json_schema_extra={"section": "Batch"},
    )
    group_size: Annotated[int, InConfig("group_size"), PlanFlag(required=True)] = Field(
        4, ge=1, le=4096, title="Group size", description="rollouts per task", json_schema_extra={"section": "Batch"}
    )
    shards: Annotated[int, InConfig("shards"), PlanFlag(required=True)] = Field(
        2,
        ge=1,
        le=1024,
        title="Shards",
        description="one generate task each, at most the number of tasks",
        json_schema_extra={"section": "Batch"},
    )
    max_turns: Annotated[int, InConfig("max_turns")] = Field(
        5,
        ge=1,
        le=1024,
        title="Max turns",
        description="model calls per rollout, at most",
        json_schema_extra={"section": "Batch"},
    )
    max_in_flight: Annotated[int, InConfig("max_in_flight")] = Field(
        64,
        ge=1,
        title="Max in flight",
        description="rollouts run at once per shard",
        json_schema_extra={"section": "Batch"},
    )
    resume: Annotated[Literal[RESUME_MODES], InConfig("resume")] = Field(  # type: ignore[valid-type]
        "turn",
        title="Resume",
        description="a rollout a killed or failed-over attempt left unfinished: turn replays the calls it committed "
        "and goes on live from the last (its calls may then span weight versions); restart samples it again "
        "from its first turn",
        json_schema_extra={"section": "Batch", "values_display": RESUME_LABELS},
    )
    seed: Annotated[int, InConfig("seed")] = Field(
        0,
        ge=0,
        le=MAX_SEED,
        title="Seed",
        description="batch seed: tasks and per-call sampling seeds",
        json_schema_extra={"section": "Batch"},
    )
    environment: Annotated[str, InConfig("environment"), PlanFlag(required=True)] = Field(
        "guess_number",
        min_length=1,
        title="Environment",
        description="a built-in game or a name declared in the environment registry (dags/environments.yaml); "
        "the CLI also takes agent_command, agent_callable, a package.module:Class or a prompt file "
        "(.parquet, .jsonl, .json) every worker can read",
        json_schema_extra={"section": "Environment"},  # its choices are added where the form is built
    )
    environment_options: Annotated[dict[str, Any], InConfig("environment_options"), PlanFlag("--env-option")] = Field(
        {"lo": 1, "hi": 10},
        title="Environment options",
        description="options of the environment as a JSON object, e.g. guess_number's lo/hi",
        json_schema_extra={"section": "Environment"},
    )
    message_graph: Annotated[Literal[MESSAGE_GRAPHS], InConfig("message_graph")] = Field(  # type: ignore[valid-type]
        "splice",
        title="Agent calls",
        description="agent environments: how a call whose history extends an earlier call's is prompted "
        "(independent: every call is a training row of its own)",
        json_schema_extra={"section": "Environment", "values_display": MESSAGE_GRAPH_LABELS},
    )
    model: Annotated[str, InConfig("model.reference")] = Field(
        BUNDLED_REFERENCE,
        min_length=1,
        title="Model",
        description="the bundled model, or the absolute path / file:// URI of a Hugging Face folder "
        "every worker can read",
        examples=[BUNDLED_REFERENCE],
        json_schema_extra={
            "section": "Model and engine",
            "values_display": {BUNDLED_REFERENCE: BUNDLED_LABEL},
        },
    )
    engine: Annotated[str, InConfig("engine.name")] = Field(  # a registered engine: checked with its options
        "vllm",
        min_length=1,
        title="Engine",
        description="inference backend",
        json_schema_extra={"section": "Model and engine"},
    )
    engine_options: Annotated[dict[str, Any], InConfig("engine.options"), PlanFlag("--engine-option")] = Field(
        {"max_model_len": 2048},
        title="Engine options",
        description="options of the engine as a JSON object, e.g. max_model_len, gpu_memory_utilization (a trigger "
        "sets only those the trigger policy opens; engine_kwargs, urls and api_key_file are the CLI's)",
        json_schema_extra={"section": "Model and engine"},
    )
    engine_conn_id: str | None = Field(
        None,
        title="Engine server connection",
        description="engine vllm_server: Airflow connection of type rollout_servers (or http) naming the "
        'servers (host and port, more in its extra {"urls": [...]}) with the API key as password, one the '
        "deployment lists; the CLI gives the urls engine option instead",
        json_schema_extra={"section": "Model and engine"},
    )
    weight_version: Annotated[int, InConfig("weight_version")] = Field(
        0,
        ge=0,
        title="Weight version",
        description="the version the engine starts at (a trainer passes its policy step)",
        json_schema_extra={"section": "Model and engine"},
    )
    temperature: Annotated[float, InConfig("sampling.temperature")] = Field(
        1.0,
        ge=0,
        le=100,
        allow_inf_nan=False,
        title="Temperature",
        description="sampling temperature",
        json_schema_extra={"section": "Sampling"},
    )
    top_p: Annotated[float, InConfig("sampling.top_p")] = Field(
        1.0,
        gt=0,
        le=1,
        allow_inf_nan=False,
        title="Top p",
        description="nucleus sampling threshold",
        json_schema_extra={"section": "Sampling"},
    )
    top_k: Annotated[int, InConfig("sampling.top_k")] = Field(
        -1,
        ge=-1,
        title="Top k",
        description="top-k sampling; -1 turns it off",
        json_schema_extra={"section": "Sampling"},
    )
    max_tokens: Annotated[int, InConfig("sampling.max_tokens")] = Field(
        32,
        ge=1,
        title="Max tokens",
        description="tokens per model call, at most",
        json_schema_extra={"section": "Sampling"},
    )
    on_invalid: Annotated[Literal[ON_INVALID], InConfig("on_invalid")] = Field(  # type: ignore[valid-type]
        "mask",
        title="Invalid rollouts",
        description="what the dataset does with a rollout whose lineage cannot be proven",
        json_schema_extra={"section": "Dataset", "values_display": ON_INVALID_LABELS},
    )
    advantage: Annotated[Literal[ADVANTAGES], InConfig("advantage")] = Field(  # type: ignore[valid-type]
        "grpo",
        title="Advantage estimator",
        description="how group advantages are computed",
        json_schema_extra={"section": "Dataset", "values_display": ADVANTAGE_LABELS},
    )
    storage_url: str = Field(
        default_factory=default_storage_url,
        min_length=1,
        title="Storage URL",
        description="where batches live: file:///path, s3://bucket/prefix or s3://conn_id@bucket/prefix (a trigger: at "
        "or below a URL the deployment lists)",
        json_schema_extra={"section": "Storage"},
    )
    storage_conn_id: str | None = Field(
        None,
        title="Storage connection",
        description="Airflow connection with the storage's credentials (e.g. an AWS connection), one the deployment "
        "lists; empty: none",
        json_schema_extra={"section": "Storage"},
    )
    max_invalid_row_rate: Annotated[Rate, InConfig("validation.max_invalid_row_rate")] = Field(
        0.05,
        title="Max invalid row rate",
        description="dataset suite: masked or dropped rollouts / planned rollouts, at most",
        json_schema_extra=_THRESHOLDS,
    )
    max_capture_poisoned_rate: Annotated[Rate, InConfig("validation.max_capture_poisoned_rate")] = Field(
        0.05,
        title="Max capture poisoned rate",
        description="lineage suite: capture-poisoned rollouts / planned rollouts, at most",
        json_schema_extra=_THRESHOLDS,
    )
    max_poisoned_rate: Annotated[Rate, InConfig("validation.max_poisoned_rate")] = Field(
        0.2,
        title="Max poisoned rate",
        description="lineage suite: poisoned or failed receipts / receipts, at most",
        json_schema_extra=_THRESHOLDS,
    )
    max_failure_row_rate: Annotated[Rate, InConfig("validation.max_failure_row_rate")] = Field(
        0.05,
        title="Max failure row rate",
        description="lineage suite: failure rows / model calls, at most",
        json_schema_extra=_THRESHOLDS,
    )
    min_declared_terminal_rate: Annotated[Rate, InConfig("validation.min_declared_terminal_rate")] = Field(
        0.9,
        title="Min declared terminal rate",
        description="lineage suite: receipts with a declared terminal call / ok receipts, at least",
        json_schema_extra=_THRESHOLDS,
    )
    max_group_advantage_mean: Annotated[float, InConfig("validation.max_group_advantage_mean")] = Field(
        1e-3,
        ge=0,
        allow_inf_nan=False,
        title="Max group advantage mean",
        description="dataset suite: |mean advantage| of a group, at most",
        json_schema_extra=_THRESHOLDS,
    )
    reward_min: Annotated[float | None, InConfig("validation.reward_min")] = Field(
        None,
        allow_inf_nan=False,
        title="Reward min",
        description="dataset suite: rewards below are flagged (empty: no bound)",
        json_schema_extra=_THRESHOLDS,
    )
    reward_max: Annotated[float | None, InConfig("validation.reward_max")] = Field(
        None,
        allow_inf_nan=False,
        title="Reward max",
        description="dataset suite: rewards above are flagged (empty: no bound)",
        json_schema_extra=_THRESHOLDS,
    )
    off_policy_max_ratio_deviation: Annotated[float, InConfig("validation.off_policy_max_ratio_deviation")] = Field(
        0.02,
        ge=0,
        allow_inf_nan=False,
        title="Off-policy max ratio deviation",
        description="off-policy gate (dataset suite, warns): |mean kept-set ratio - 1| and |geometric mean - 1| of "
        "the audited tokens, at most",
        json_schema_extra=_THRESHOLDS,
    )
    off_policy_ratio_bound: Annotated[float, InConfig("validation.off_policy_ratio_bound")] = Field(
        2.0,
        gt=1,
        allow_inf_nan=False,
        title="Off-policy ratio bound",
        description="off-policy gate: an audited token whose kept-set ratio is outside [1/bound, bound] is out "
        "of bounds",
        json_schema_extra=_THRESHOLDS,
    )
    off_policy_max_outside_rate: Annotated[Rate, InConfig("validation.off_policy_max_outside_rate")] = Field(
        0.01,
        title="Off-policy max outside rate",
        description="off-policy gate (dataset suite, warns): audited tokens out of bounds / audited tokens, at most",
        json_schema_extra=_THRESHOLDS,
    )
    off_policy_max_staleness: Annotated[int, InConfig("validation.off_policy_max_staleness")] = Field(
        0,
        ge=0,
        title="Off-policy max staleness",
        description="off-policy gate (dataset suite, warns): weight versions an audited token's is behind the "
        "batch's weight_version, at most",
        json_schema_extra=_THRESHOLDS,
    )
    require_review: bool = Field(
        False,
        title="Require review",
        description="wait for a person's decision before publish even when both suites pass "
        "(a suite that warned always waits)",
        json_schema_extra={"section": "Review"},
    )
    review_timeout_hours: float = Field(
        24,
        gt=0,
        le=MAX_REVIEW_TIMEOUT_HOURS,
        allow_inf_nan=False,
        title="Review timeout (hours)",
        description="a review nobody answers within this time rejects the batch (reason review_timeout) "
        "and fails the run",
        json_schema_extra={"section": "Review"},
    )

    @model_validator(mode="before")
    @classmethod
    def _options_follow_their_choice(cls, data: Any) -> Any:
        """Values naming another environment (engine) than the default and no options get no options."""
        if isinstance(data, Mapping):
            for choice, options in OPTIONS_OF.items():
                if options not in data and data.get(choice, field_default(choice)) != field_default(choice):
                    data = {**data, options: {}}
        return data

    def config_tree(self) -> dict[str, Any]:
        """The values that reach the batch config, nested as the config nests them (``{"sampling": {...}}``)."""
        tree: dict[str, Any] = {}
        for name, path in config_paths().items():
            *parents, leaf = path.split(".")
            node = tree
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = getattr(self, name)
        return tree


OPTIONS_OF = {"environment": "environment_options", "engine": "engine_options"}  # choice -> its options field


def _marker(name: str, kind: type) -> Any:
    return next((m for m in BatchFields.model_fields[name].metadata if isinstance(m, kind)), None)


@functools.cache
def config_paths() -> dict[str, str]:
    """Field name -> its dotted path in the batch config, for every field that reaches the config."""
    return {name: m.path for name in BatchFields.model_fields if (m := _marker(name, InConfig)) is not None}


@functools.cache
def run_fields() -> tuple[str, ...]:
    """The fields that never reach the config: about the run (id, review) or where its batch is stored."""
    return tuple(name for name in BatchFields.model_fields if name not in config_paths())


def plan_flag(name: str) -> PlanFlag:
    """How ``rollout-ledger plan`` takes field ``name`` (every field that reaches the config has a flag)."""
    declared = _marker(name, PlanFlag) or PlanFlag()
    return PlanFlag(declared.name or f"--{name.replace('_', '-')}", declared.required)


def field_default(name: str, environ: Mapping[str, str] = os.environ) -> Any:
    """The default of field ``name`` (``storage_url``'s follows ``environ``)."""
    info = BatchFields.model_fields[name]
    if info.default_factory is default_storage_url:
        return default_storage_url(environ)
    return info.get_default(call_default_factory=True)


def field_defaults(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Every field's default, in form order."""
    return {name: field_default(name, environ) for name in BatchFields.model_fields}


@functools.cache
def json_schemas() -> dict[str, dict[str, Any]]:
    """Field name -> its JSON Schema (``title``, ``description``, ``section``, type and bounds; no default)."""
    schema = BatchFields.model_json_schema()
    return {name: _without_default(_nullable(spec)) for name, spec in schema["properties"].items()}


def _nullable(spec: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [X, {type: null}]`` as one schema with ``type: [null, X's type]`` (the form reads ``type``)."""
    variants = spec.get("anyOf")
    if not variants or len(variants) != 2 or {"type": "null"} not in variants:
        return spec
    (other,) = (v for v in variants if v != {"type": "null"})
    rest = {k: v for k, v in spec.items() if k != "anyOf"}
    return {**rest, **other, "type": ["null", other["type"]]}


def _without_default(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k != "default"}


def check_values(values: Mapping[str, Any], *, source: str = "batch values") -> BatchFields:
    """``values`` (any subset of the fields; the rest take their defaults) checked; a ConfigError names each bad one."""
    unknown = sorted(set(values) - set(BatchFields.model_fields))
    if unknown:
        raise ConfigError(f"{source}: unknown batch field(s) {unknown}; known: {sorted(BatchFields.model_fields)}")
    try:
        return BatchFields.model_validate(dict(values))
    except ValidationError as exc:
        bad = dict.fromkeys(str(e["loc"][0]) if e["loc"] else e["msg"] for e in exc.errors(include_url=False))
        reasons = [_refusal(n, n, values.get(n)) if n in BatchFields.model_fields else n for n in bad]
        raise ConfigError(f"{source}: {'; '.join(reasons)}") from None


def check_recorded(record: object, *, prefix: str = "") -> None:
    """Check the declared fields a config record holds against their declaration; a ConfigError names the first bad one.

    ``record`` is the batch config (``prefix`` empty) or its part at ``prefix`` (``validation``);
    every field whose config path lies under it is read from it and checked as the form checks it.
    """
    for name, path in config_paths().items():
        if prefix and not path.startswith(f"{prefix}."):
            continue
        value = record
        for part in path.removeprefix(f"{prefix}.").split("."):
            value = getattr(value, part)
        try:
            _adapter(name).validate_python(value)
        except ValidationError:
            raise ConfigError(_refusal(path, name, value)) from None


@functools.cache
def _adapter(name: str) -> TypeAdapter[Any]:
    info = BatchFields.model_fields[name]
    return TypeAdapter(Annotated[info.annotation, info], config=ConfigDict(strict=True))


def rule(name: str) -> str:
    """What field ``name`` accepts, in words, from its JSON Schema: ``an int in [1, 1000000]``, ``one of [...]``."""
    schema = json_schemas()[name]
    kinds = schema.get("type")
    nullable = isinstance(kinds, list) and "null" in kinds
    kind = next(k for k in kinds if k != "null") if isinstance(kinds, list) else kinds
    if "enum" in schema:
        text = f"one of {schema['enum']}"
    elif kind in ("integer", "number"):
        text = ("an int" if kind == "integer" else "a finite number") + _bounds(schema)
    elif kind == "string":
        text = "a non-empty str" if schema.get("minLength") else "a str"
        if "pattern" in schema:
            text = f"a str matching {schema['pattern']}"
        if "maxLength" in schema:
            text += f" of at most {schema['maxLength']} characters"
    elif kind == "object":
        text = "a JSON object"
    elif kind == "boolean":
        text = "true or false"
    else:
        text = f"of JSON type {kind}"
    return f"{text} or null" if nullable else text


def _bounds(schema: Mapping[str, Any]) -> str:
    low = ("[", schema["minimum"]) if "minimum" in schema else ("(", schema.get("exclusiveMinimum"))
    high = ("]", schema["maximum"]) if "maximum" in schema else (")", schema.get("exclusiveMaximum"))
    if low[1] is not None and high[1] is not None:
        return f" in {low[0]}{_number(low[1])}, {_number(high[1])}{high[0]}"
    if low[1] is not None:
        return f" {'>=' if low[0] == '[' else '>'} {_number(low[1])}"
    if high[1] is not None:
        return f" {'<=' if high[0] == ']' else '<'} {_number(high[1])}"
    return ""


def _number(bound: float) -> str:
    """A bound as written by people: ``2**63 - 1`` for the edge of the int64 range."""
    return "2**63 - 1" if bound == MAX_SEED else str(bound)


def _refusal(label: str, name: str, value: Any) -> str:
    return f"{label} must be {rule(name)}, got {value!r}"
