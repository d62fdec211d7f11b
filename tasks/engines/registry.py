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
from tasks.errors import ConfigError
from tasks.sampling import SamplingSettings

if TYPE_CHECKING:
    from tasks.engines.base import Engine


@dataclass(frozen=True)
class EngineEntry:
    """One registered engine: its label in the UI, its options model, and where its class is (``module:Class``).

    ``loads_model`` is true for an engine that loads the model inside the generate task (which then
    needs the worker's accelerator). ``weights_check`` (``module:function``, for engines that call
    weights loaded elsewhere) judges at plan time how the served weights are known to be the
    planned model's; without one, every worker hashes the weights it loads. ``sampling_masks``: the
    engine returns each truncated call's kept sets (:mod:`tasks.engines.sampling_masks`); planning
    refuses top-p / top-k sampling on one that does not (:func:`check_sampling_masks`).
    ``sampling_limits`` (``module:function``, light: settings → why the engine cannot sample them, or
    None) names sampling settings the engine refuses; planning refuses them too.
    """

    label: str
    options: type[EngineOptions]
    engine_class: str
    loads_model: bool = True
    weights_check: str | None = None
    sampling_masks: bool = True
    sampling_limits: str | None = None


ENGINES: Mapping[str, EngineEntry] = {
    "vllm": EngineEntry("vLLM", VllmOptions, "tasks.engines.vllm.engine:VllmEngine"),
    "vllm_server": EngineEntry(
        "vLLM servers (running vllm serve)",
        VllmServerOptions,
        "tasks.engines.vllm_server.engine:VllmServerEngine",
        loads_model=False,
        weights_check="tasks.engines.vllm_server.claims:planned_weights",
    ),
    "megatron": EngineEntry(
        "Megatron-core (GPU workers)",
        MegatronOptions,
        "tasks.engines.megatron.engine:MegatronEngine",
        sampling_limits="tasks.engines.megatron.sampling:refusal",
    ),
}


def engine_names() -> tuple[str, ...]:
    """The registered engine names, in registry order."""
    return tuple(ENGINES)


def engine_labels() -> dict[str, str]:
    """Engine name → its label for people (the Airflow form's engine choices)."""
    return {name: entry.label for name, entry in ENGINES.items()}


def loads_model(name: str) -> bool:
    """Whether engine ``name`` loads the model inside the generate task (so that task needs an accelerator)."""
    return _entry(name).loads_model


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


def check_sampling_masks(name: str, sampling: SamplingSettings) -> None:
    """A ConfigError when ``sampling`` truncates (top-p, top-k) and engine ``name`` cannot record the kept sets:
    a trainer could not renormalize over them, so those calls could not be proven (docs/finalization.md); or
    when the engine cannot sample ``sampling`` at all (its ``sampling_limits``: megatron, top-k with top-p)."""
    entry = _entry(name)
    if entry.sampling_limits is not None:
        reason = _imported(entry.sampling_limits)(sampling)
        if reason is not None:
            raise ConfigError(f"engine {name} cannot sample with these settings: {reason}")
    if sampling.truncates and not entry.sampling_masks:
        raise ConfigError(
            f"engine {name} cannot record sampling masks, so it cannot sample with top_p {sampling.top_p} / top_k "
            f"{sampling.top_k} provably: sample with top_p 1 and top_k -1, or use an engine that records them "
            f"({', '.join(n for n, entry in ENGINES.items() if entry.sampling_masks)})"
        )


def engine_class(name: str) -> type[Engine]:
    """The engine class of ``name``, imported now (this imports the engine's own stack, e.g. PyTorch)."""
    return _imported(_entry(name).engine_class)


def planned_weights(name: str, options: Mapping[str, Any] | None, model_folder: Path) -> str:
    """How engine ``name``'s weights are known to be the planned model in ``model_folder`` (``model.weights``).

    :data:`~tasks.models.provenance.WEIGHTS_VERIFIED` for an engine that loads the weights on its
    worker (the worker hashes them); an engine with a ``weights_check`` asks it (it may call servers,
    and refuses another model).
    """
    from tasks.models.provenance import WEIGHTS_VERIFIED

    entry = _entry(name)
    if entry.weights_check is None:
        return WEIGHTS_VERIFIED
    try:
        checked = check_engine(name, options)
    except ValueError as error:  # a bad option is the planner's to fix: a usage error, before any server is asked
        raise ConfigError(str(error)) from None
    return _imported(entry.weights_check)(checked, model_folder)


def _imported(where: str) -> Any:
    module_name, _, attribute = where.partition(":")
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
