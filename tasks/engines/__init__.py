"""Inference engines behind one interface (:class:`tasks.engines.base.Engine`), chosen by name: vLLM, Megatron-core."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.engines.base import Engine, GenerationRequest, GenerationResult, SamplingSettings
from tasks.errors import EngineDeadError, EngineError

ENGINE_NAMES = ("vllm", "megatron")

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
    """Refuse an unknown engine name or options it would refuse, without starting anything (ValueError).

    Checks options only: whether this machine can run the engine (an extra, a GPU) is known
    where it starts, which may be another machine than the one that plans.
    """
    if name not in ENGINE_NAMES:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINE_NAMES)}")
    if name == "megatron":
        from tasks.engines.megatron import MegatronOptions

        MegatronOptions.from_mapping(options)
    else:
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
    if name == "megatron":
        from tasks.engines.megatron import MegatronEngine

        return await MegatronEngine.create(model_path, options, weight_version=weight_version)
    from tasks.engines.vllm import VllmEngine

    return await VllmEngine.create(model_path, options, weight_version=weight_version)
