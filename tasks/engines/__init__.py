"""Inference engines behind one interface (:class:`tasks.engines.base.Engine`), chosen by name."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.engines.base import (
    Engine,
    EngineDeadError,
    EngineError,
    GenerationRequest,
    GenerationResult,
    SamplingSettings,
)

ENGINE_NAMES = ("vllm",)
# Named in the contract, arriving in this wave: refused at plan time with this message.
PLANNED_ENGINES = {"megatron": "the Megatron-core engine is not available yet (its issue is open); use 'vllm'"}

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "GenerationRequest",
    "GenerationResult",
    "SamplingSettings",
    "check_engine",
    "create_engine",
]


def check_engine(name: object, options: Mapping[str, Any] | None) -> None:
    """Refuse an unknown engine name or options it would refuse, without starting anything (ValueError)."""
    if name in PLANNED_ENGINES:
        raise ValueError(f"engine {name!r}: {PLANNED_ENGINES[name]}")
    if name not in ENGINE_NAMES:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINE_NAMES)}")
    from tasks.engines.vllm import VllmOptions

    VllmOptions.from_mapping(options)


async def create_engine(
    name: str, *, model_path: str | Path, options: Mapping[str, Any] | None = None, weight_version: int = 0
) -> Engine:
    """Start engine ``name`` on the local model folder ``model_path`` at ``weight_version``.

    Async because an engine binds to the event loop that creates it: create it on the loop
    that will call it (from sync code: ``BackgroundLoop().run(create_engine(...))``).
    """
    check_engine(name, options)
    from tasks.engines.vllm import VllmEngine

    return await VllmEngine.create(model_path, options, weight_version=weight_version)
