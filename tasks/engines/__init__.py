"""Inference engines behind one interface (:class:`tasks.engines.base.Engine`), chosen by name."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.engines.base import Engine, EngineError, GenerationRequest, GenerationResult, SamplingSettings

ENGINE_NAMES = ("vllm", "megatron")
MEGATRON_ISSUE = "the Megatron-core engine is not implemented yet (tracked as the 'Megatron-core engine' issue)"

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineError",
    "GenerationRequest",
    "GenerationResult",
    "SamplingSettings",
    "create_engine",
]


async def create_engine(
    name: str, *, model_path: str | Path | None, options: Mapping[str, Any] | None = None
) -> Engine:
    """Start engine ``name`` on ``model_path`` (``None``: the bundled model) with its ``options``.

    Async because an engine binds to the event loop that creates it: create it on the loop
    that will call it (from sync code: ``BackgroundLoop().run(create_engine(...))``).
    """
    if name == "vllm":
        from tasks.engines.vllm import VllmEngine
        from tasks.models.bundled import resolve_model

        return await VllmEngine.create(resolve_model(None if model_path is None else str(model_path)), options)
    if name == "megatron":
        raise NotImplementedError(MEGATRON_ISSUE)
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINE_NAMES)}")
