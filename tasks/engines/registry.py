"""The inference engines this project can start, by name: label, options model and engine class of each.

Importing this module is light (pydantic and the options modules only; no numpy, PyTorch, vLLM
or megatron-core): the Airflow DAG parse imports it to build the form's engine choices
(:func:`engine_labels`), and planning checks a batch's engine with :func:`check_engine` on machines
that cannot run it. An engine class is imported only when an engine is started
(:func:`create_engine`) or asked for (:func:`engine_class`).

Adding an engine: a package ``tasks/engines/<name>/`` with a light ``options.py`` (an
:class:`~tasks.engines.options.EngineOptions` subclass) and an :class:`~tasks.engines.base.Engine`
subclass implementing ``create``; one entry in :data:`ENGINES`; its tests. See docs/generation.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.engines.megatron.options import MegatronOptions
from tasks.engines.options import EngineOptions
from tasks.engines.vllm.options import VllmOptions
from tasks.engines.vllm_server.options import VllmServerOptions

if TYPE_CHECKING:
    from tasks.engines.base import Engine


@dataclass(frozen=True)
class EngineEntry:
    """One registered engine: its label in the UI, its options model, and where its class is (``module:Class``)."""

    label: str
    options: type[EngineOptions]
    engine_class: str


ENGINES: Mapping[str, EngineEntry] = {
    "vllm": EngineEntry("vLLM", VllmOptions, "tasks.engines.vllm.engine:VllmEngine"),
    "vllm_server": EngineEntry(
        "vLLM servers (running vllm serve)", VllmServerOptions, "tasks.engines.vllm_server.engine:VllmServerEngine"
    ),
    "megatron": EngineEntry(
        "Megatron-core (GPU workers)", MegatronOptions, "tasks.engines.megatron.engine:MegatronEngine"
    ),
}


def engine_names() -> tuple[str, ...]:
    """The registered engine names, in registry order."""
    return tuple(ENGINES)


def engine_labels() -> dict[str, str]:
    """Engine name → its label for people (the Airflow form's engine choices)."""
    return {name: entry.label for name, entry in ENGINES.items()}


def _entry(name: object) -> EngineEntry:
    if not isinstance(name, str) or name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    return ENGINES[name]


def options_model(name: str) -> type[EngineOptions]:
    """The options class of engine ``name`` (ValueError for an unknown name)."""
    return _entry(name).options


def options_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of engine ``name``'s options (unknown keys refused: ``additionalProperties: false``)."""
    return options_model(name).model_json_schema()


def check_engine(name: object, options: Mapping[str, Any] | None) -> EngineOptions:
    """The options engine ``name`` would start with, or a ValueError naming the unknown engine or the bad option.

    Checks the name and options only and starts nothing: whether this machine can run the engine
    (an extra, a GPU) is known where it starts, which may be another machine than the one that plans.
    """
    return _entry(name).options.from_mapping(options)


def engine_class(name: str) -> type[Engine]:
    """The engine class of ``name``, imported now (this imports the engine's own stack, e.g. PyTorch)."""
    module_name, _, attribute = _entry(name).engine_class.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


async def create_engine(
    name: str, *, model_path: str | Path, options: Mapping[str, Any] | None = None, weight_version: int = 0
) -> Engine:
    """Start engine ``name`` on the local model folder ``model_path`` at ``weight_version``.

    Async because an engine binds to the event loop that creates it: create it on the loop
    that will call it (from sync code: ``BackgroundLoop().run(create_engine(...))``).
    """
    checked = check_engine(name, options)
    return await engine_class(name).create(model_path, checked, weight_version=weight_version)
