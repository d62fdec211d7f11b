"""The batch config (ARCHITECTURE section 12): everything that defines a batch, in one place.

Fixed at plan time, written once as ``plan/batch.json``, read by every later stage. Defaults
and validation live here and nowhere else. Later stages may override only what is safe
(``on_invalid``, ``advantage``, validation thresholds) through :meth:`BatchConfig.with_overrides`.
Storage credentials never go in it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from tasks.engines.base import SamplingSettings
from tasks.ids import check_id

CONFIG_VERSION = 2  # 2: portable model reference, validated engine, weight_version honoured
DIVERGENCE_POLICIES = ("poison",)
ON_INVALID = ("mask", "drop")
ADVANTAGES = ("grpo", "dr_grpo", "rloo")
SAFE_OVERRIDES = ("on_invalid", "advantage", "validation")
_HEX_SHA256 = re.compile(r"[0-9a-f]{64}")


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
        if not isinstance(self.reference, str) or not self.reference:
            raise ConfigError(f"model.reference must be a non-empty str, got {self.reference!r}")
        for name in ("weights_sha256", "tokenizer_sha256", "chat_template_sha256"):
            value = getattr(self, name)
            if not isinstance(value, str) or (value and not _HEX_SHA256.fullmatch(value)):
                raise ConfigError(f"model.{name} must be 64 lowercase hex digits (or empty), got {value!r}")

    @property
    def provenance(self) -> dict[str, str]:
        return {n: getattr(self, n) for n in ("weights_sha256", "tokenizer_sha256", "chat_template_sha256")}


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
        if not isinstance(self.environment, str) or not self.environment:
            raise ConfigError(f"environment must be a non-empty str, got {self.environment!r}")
        _positive(self, "num_tasks", "group_size", "shards", "max_turns", "max_in_flight")
        if self.shards > self.num_tasks:
            raise ConfigError(
                f"shards ({self.shards}) cannot exceed num_tasks ({self.num_tasks}): a group never spans shards"
            )
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.weight_version, int) or self.weight_version < 0:
            raise ConfigError(f"weight_version must be an int >= 0, got {self.weight_version!r}")
        _choice(self.divergence_policy, DIVERGENCE_POLICIES, "divergence_policy")
        _choice(self.on_invalid, ON_INVALID, "on_invalid")
        _choice(self.advantage, ADVANTAGES, "advantage")
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
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source} is not valid JSON: {exc}") from None
        return _build(cls, raw, source)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "batch config") -> Self:
        return _build(cls, raw, source)

    def with_overrides(self, **overrides: Any) -> Self:
        """A copy with later-stage overrides; only ``on_invalid``, ``advantage``, ``validation``."""
        unsafe = sorted(set(overrides) - set(SAFE_OVERRIDES))
        if unsafe:
            raise ConfigError(f"{unsafe} cannot be changed after planning; only {list(SAFE_OVERRIDES)} can")
        return dataclasses.replace(self, **overrides)


def _positive(config: BatchConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")


def _choice(value: object, allowed: tuple[str, ...], name: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _build(cls: type, raw: object, where: str) -> Any:
    """Construct dataclass ``cls`` from JSON data, refusing unknown or missing fields by name."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a JSON object, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}")
    kwargs = {}
    for name, value in raw.items():
        target = _dataclass_in(hints[name])
        kwargs[name] = _build(target, value, f"{where}.{name}") if target is not None else value
    missing = sorted(
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    if missing:
        raise ConfigError(f"{where}: missing field(s) {missing}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _dataclass_in(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg):
                return arg
    return None
