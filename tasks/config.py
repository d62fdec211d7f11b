"""The batch config (ARCHITECTURE section 12): everything that defines a batch, in one place.

Fixed at plan time, written once as ``plan/batch.json``, read by every later stage. Defaults
and validation live here and nowhere else. Later stages may override only what is safe
(``on_invalid``, ``advantage``, validation thresholds) through :meth:`BatchConfig.with_overrides`.
Storage credentials never go in it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from tasks.checks import check_choice, check_hex_digest, check_int, check_text
from tasks.engines.base import SamplingSettings
from tasks.ids import check_id
from tasks.strict_json import load_dataclass, parse_json

CONFIG_VERSION = 2  # 2: portable model reference, validated engine, weight_version honoured
DIVERGENCE_POLICIES = ("poison",)
ON_INVALID = ("mask", "drop")
ADVANTAGES = ("grpo", "dr_grpo", "rloo")
SAFE_OVERRIDES = ("on_invalid", "advantage", "validation")
PROVENANCE_FIELDS = ("weights_sha256", "tokenizer_sha256", "chat_template_sha256")


class ConfigError(ValueError):
    """A batch config field is missing, unknown or out of range; the message names it."""


@dataclass(frozen=True)
class ModelSpec:
    """Which weights generate the batch: a portable reference (``bundled:<name>`` or a folder every
    worker can read, :mod:`tasks.models.reference`) and its provenance (sha256 of each part; generate
    refuses a resolved model whose hashes differ)."""

    reference: str
    weights_sha256: str = ""
    tokenizer_sha256: str = ""
    chat_template_sha256: str = ""

    def __post_init__(self) -> None:
        check_text(self.reference, field="model.reference", error=ConfigError)
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


@dataclass(frozen=True)
class ValidationSpec:
    """Thresholds the validation stages enforce."""

    max_invalid_row_rate: float = 0.05
    max_capture_poisoned_rate: float = 0.05


@dataclass(frozen=True)
class BatchConfig:
    batch_id: str
    environment: str
    num_tasks: int
    group_size: int
    shards: int
    model: ModelSpec
    environment_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    engine: EngineSpec = field(default_factory=EngineSpec)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    max_turns: int = 8
    max_in_flight: int = 64
    divergence_policy: str = "poison"
    on_invalid: str = "mask"
    advantage: str = "grpo"
    weight_version: int = 0
    staging: StagingSpec = field(default_factory=StagingSpec)
    validation: ValidationSpec = field(default_factory=ValidationSpec)
    code_version: str = ""
    config_version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        try:
            check_id(self.batch_id, field="batch_id")
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        check_text(self.environment, field="environment", error=ConfigError)
        for name in ("num_tasks", "group_size", "shards", "max_turns", "max_in_flight"):
            check_int(getattr(self, name), field=name, minimum=1, error=ConfigError)
        if self.shards > self.num_tasks:
            raise ConfigError(
                f"shards ({self.shards}) cannot exceed num_tasks ({self.num_tasks}): a group never spans shards"
            )
        check_int(self.seed, field="seed", maximum=2**63 - 1, error=ConfigError)
        check_int(self.weight_version, field="weight_version", error=ConfigError)
        check_choice(self.divergence_policy, DIVERGENCE_POLICIES, field="divergence_policy", error=ConfigError)
        check_choice(self.on_invalid, ON_INVALID, field="on_invalid", error=ConfigError)
        check_choice(self.advantage, ADVANTAGES, field="advantage", error=ConfigError)
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
        """The config from parsed JSON; unknown, missing or invalid fields raise :class:`ConfigError` naming them."""
        return load_dataclass(cls, raw, source=source, error=ConfigError)

    def with_overrides(self, **overrides: Any) -> Self:
        """A copy with later-stage overrides; only ``on_invalid``, ``advantage``, ``validation``."""
        unsafe = sorted(set(overrides) - set(SAFE_OVERRIDES))
        if unsafe:
            raise ConfigError(f"{unsafe} cannot be changed after planning; only {list(SAFE_OVERRIDES)} can")
        return dataclasses.replace(self, **overrides)
