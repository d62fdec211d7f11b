"""The batch config: everything that defines a batch, in one place.

Fixed at plan time, written once as ``plan/batch.json``, read by every later stage. The fields a
user sets (their defaults, bounds and choices) are declared in :mod:`tasks.batch_fields` and
checked from there (:func:`~tasks.batch_fields.check_recorded`); the rules across fields
(``shards <= num_tasks``, ``reward_min <= reward_max``) and the record's own fields (ids,
hashes, versions) are checked here. :func:`config_from_values` builds a config from the form's
or the plan flags' values. Later stages may override only what is safe (``on_invalid``,
``advantage``, validation thresholds) through :meth:`BatchConfig.with_overrides`. Storage
credentials never go in it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from tasks.batch_fields import check_recorded, check_values, config_paths, field_default
from tasks.checks import check_choice, check_finite, check_hex_digest, check_int, check_text
from tasks.errors import ConfigError
from tasks.ids import check_id
from tasks.models.provenance import WEIGHT_CHECKS, WEIGHTS_VERIFIED
from tasks.sampling import SamplingSettings
from tasks.strict_json import load_dataclass, parse_json

CONFIG_VERSION = 2  # 2: portable model reference, validated engine, weight_version honoured
DIVERGENCE_POLICIES = ("poison",)
SAFE_OVERRIDES = ("on_invalid", "advantage", "validation")
PROVENANCE_FIELDS = ("weights_sha256", "tokenizer_sha256", "chat_template_sha256")


@dataclass(frozen=True)
class ModelSpec:
    """Which weights generate the batch: a portable reference (``bundled:<name>`` or a folder every
    worker can read, :mod:`tasks.models.reference`) and its provenance (sha256 of each part; generate
    refuses a resolved model whose hashes differ)."""

    reference: str
    weights_sha256: str = ""
    tokenizer_sha256: str = ""
    chat_template_sha256: str = ""
    # verified: every worker hashes the weights it generates with; declared, not verified: a server's
    # weights, accepted by its model name (engine vllm_server, option served_model)
    weights: str = WEIGHTS_VERIFIED

    def __post_init__(self) -> None:
        check_text(self.reference, field="model.reference", error=ConfigError)
        check_choice(self.weights, WEIGHT_CHECKS, field="model.weights", error=ConfigError)
        for name in PROVENANCE_FIELDS:
            if getattr(self, name) != "":  # empty: not recorded
                check_hex_digest(getattr(self, name), field=f"model.{name}", error=ConfigError)

    @property
    def provenance(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in PROVENANCE_FIELDS}


@dataclass(frozen=True)
class EngineSpec:
    """Inference backend name (``vllm``) and its options; both checked when the config is built."""

    name: str = "vllm"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from tasks.engines import check_engine

        if not isinstance(self.options, dict):
            raise ConfigError(f"engine.options must be a JSON object, got {self.options!r}")
        try:
            check_engine(self.name, self.options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"engine: {exc}") from None


@dataclass(frozen=True)
class StagingSpec:
    """Group-commit thresholds of the staging writer."""

    max_rows: int = 512
    max_bytes: int = 8 * 1024 * 1024
    max_delay_ms: float = 50.0

    def __post_init__(self) -> None:
        check_int(self.max_rows, field="staging.max_rows", minimum=1, error=ConfigError)
        check_int(self.max_bytes, field="staging.max_bytes", minimum=1, error=ConfigError)
        if check_finite(self.max_delay_ms, field="staging.max_delay_ms", error=ConfigError) < 0:
            raise ConfigError(f"staging.max_delay_ms must be >= 0, got {self.max_delay_ms!r}")


@dataclass(frozen=True)
class ValidationSpec:
    """Thresholds of the validation suites (``tasks/validate``); later stages may override them.

    Rates are fractions in [0, 1]. Which expectation fails a batch and which only warns is the
    suite's decision (documented there); these numbers are the lines they draw.
    """

    max_invalid_row_rate: float = field_default("max_invalid_row_rate")
    max_capture_poisoned_rate: float = field_default("max_capture_poisoned_rate")
    max_poisoned_rate: float = field_default("max_poisoned_rate")
    max_failure_row_rate: float = field_default("max_failure_row_rate")
    min_declared_terminal_rate: float = field_default("min_declared_terminal_rate")
    max_group_advantage_mean: float = field_default("max_group_advantage_mean")
    reward_min: float | None = field_default("reward_min")  # None: no bound
    reward_max: float | None = field_default("reward_max")
    off_policy_max_ratio_deviation: float = field_default("off_policy_max_ratio_deviation")
    off_policy_ratio_bound: float = field_default("off_policy_ratio_bound")
    off_policy_max_outside_rate: float = field_default("off_policy_max_outside_rate")
    off_policy_max_staleness: int = field_default("off_policy_max_staleness")

    def __post_init__(self) -> None:
        check_recorded(self, prefix="validation")
        if self.reward_min is not None and self.reward_max is not None and self.reward_min > self.reward_max:
            raise ConfigError(f"validation.reward_min {self.reward_min} exceeds reward_max {self.reward_max}")

    @classmethod
    def of_recorded(cls, thresholds: Mapping[str, float | None], *, source: str = "thresholds") -> ValidationSpec:
        """The spec a suite summary recorded (its ``thresholds``); fields it lacks take their defaults."""
        return load_dataclass(cls, dict(thresholds), source=source, error=ConfigError)


def _default_sampling() -> SamplingSettings:
    """The declared sampling defaults (the engine's own defaults are for callers without a batch)."""
    return SamplingSettings(
        **{
            path.removeprefix("sampling."): field_default(name)
            for name, path in config_paths().items()
            if path.startswith("sampling.")
        }
    )


@dataclass(frozen=True)
class BatchConfig:
    batch_id: str
    environment: str
    num_tasks: int
    group_size: int
    shards: int
    model: ModelSpec
    environment_options: dict[str, Any] = field(default_factory=dict)
    seed: int = field_default("seed")
    engine: EngineSpec = field(default_factory=EngineSpec)
    sampling: SamplingSettings = field(default_factory=_default_sampling)
    max_turns: int = field_default("max_turns")
    max_in_flight: int = field_default("max_in_flight")
    divergence_policy: str = "poison"
    message_graph: str = field_default("message_graph")
    resume: str = field_default("resume")
    on_invalid: str = field_default("on_invalid")
    advantage: str = field_default("advantage")
    weight_version: int = field_default("weight_version")
    staging: StagingSpec = field(default_factory=StagingSpec)
    validation: ValidationSpec = field(default_factory=ValidationSpec)
    code_version: str = ""
    config_version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        try:
            check_id(self.batch_id, field="batch_id")
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        check_recorded(self)
        if self.shards > self.num_tasks:
            raise ConfigError(
                f"shards ({self.shards}) cannot exceed num_tasks ({self.num_tasks}): a group never spans shards"
            )
        check_choice(self.divergence_policy, DIVERGENCE_POLICIES, field="divergence_policy", error=ConfigError)
        if not isinstance(self.code_version, str):
            raise ConfigError(f"code_version must be a str, got {self.code_version!r}")
        if self.config_version != CONFIG_VERSION:
            raise ConfigError(f"config_version {self.config_version!r} is not supported (expected {CONFIG_VERSION})")

    @property
    def num_rollouts(self) -> int:
        return self.num_tasks * self.group_size

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, two-space indent, a trailing newline."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "batch config") -> Self:
        return cls.from_dict(parse_json(text, source=source, error=ConfigError), source=source)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "batch config") -> Self:
        """The config from parsed JSON; unknown, missing or invalid fields raise :class:`ConfigError` naming them.

        A config of another version is refused first, by :func:`check_config_version`.
        """
        check_config_version(raw, source=source)
        return load_dataclass(cls, raw, source=source, error=ConfigError)

    def with_overrides(self, **overrides: Any) -> Self:
        """A copy with later-stage overrides; only ``on_invalid``, ``advantage``, ``validation``."""
        unsafe = sorted(set(overrides) - set(SAFE_OVERRIDES))
        if unsafe:
            raise ConfigError(f"{unsafe} cannot be changed after planning; only {list(SAFE_OVERRIDES)} can")
        return dataclasses.replace(self, **overrides)


def config_from_values(
    values: Mapping[str, Any], *, batch_id: str, model: Mapping[str, str], source: str = "batch values"
) -> BatchConfig:
    """The config the batch fields' ``values`` describe (the rest take their defaults); a ConfigError names a bad field.

    ``values["model"]`` is a portable model reference (:func:`tasks.models.reference.model_reference`)
    and ``model`` what planning found of it: its three hashes and ``weights``. Fields that never reach
    the config (run and storage fields) are checked and left out. :func:`tasks.plan.plan_from_values`
    resolves and hashes the model first.
    """
    from tasks.version import code_version

    tree = check_values(values, source=source).config_tree()
    tree["model"] = {**tree["model"], **model}
    return BatchConfig.from_dict({**tree, "batch_id": batch_id, "code_version": code_version()}, source=source)


def check_config_version(raw: object, *, source: str) -> None:
    """:class:`ConfigError` naming ``source``, its version and what to do, unless ``raw`` is a version-2 config.

    Version 2 configs written before the validation thresholds past the first two existed lack
    them and read with their defaults (thresholds may be overridden later anyway). Version 1 is
    refused: its model is a path rather than a portable reference, its engine options were not
    checked and its engines ignored ``weight_version``, so its batch cannot be read as planned.
    """
    if not isinstance(raw, Mapping) or "config_version" not in raw:
        return  # the loader names what is wrong with it
    version = raw["config_version"]
    if type(version) is int and version == CONFIG_VERSION:
        return
    if type(version) is int and version == 1:
        step = (
            "version 1 named the model by path and ran engines that ignored weight_version, so the batch cannot "
            "be read as planned: re-plan it under a new batch id (`rollout-ledger plan --batch-id NEW ...`) and "
            "generate it again"
        )
    else:
        step = "it was written by newer code: read it with that code"
    raise ConfigError(
        f"{source}: config_version {version!r} is not supported (this code reads {[CONFIG_VERSION]}); {step}"
    )
