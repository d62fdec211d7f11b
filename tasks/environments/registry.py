"""Loading an environment from the batch config's spec: a registry name, a built-in name, ``pkg.module:Class``, or a
prompt file.

Resolution order: a name of the deployment's registry (:mod:`tasks.environments.declared`) is its
entry; without ``Runnables.direct`` nothing but that and the built-in games loads. Then a spec
ending in ``.parquet`` / ``.jsonl`` / ``.json`` is a prompt file (its path becomes the ``path``
option); a spec containing ``:`` is an import path whose attribute must be an
:class:`Environment` or :class:`~tasks.environments.agents.Agent` subclass; anything else must be
a built-in name (the games, and the agents ``agent_command`` and ``agent_callable``). Every failure
is an :class:`EnvironmentLoadError` whose ``reason`` is one of :data:`tasks.errors.ENVIRONMENT_LOAD_REASONS`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.environments.agents import Agent, AgentCallable, AgentCommand
from tasks.environments.arithmetic import Arithmetic
from tasks.environments.base import Environment
from tasks.environments.calculator import Calculator
from tasks.environments.declared import EnvironmentRegistry, load_registry
from tasks.environments.guess_number import GuessNumber
from tasks.environments.imports import ImportPathError, import_object
from tasks.environments.pinned_file import recorded_path
from tasks.environments.prompts_file import SUFFIXES, PromptsFile, is_prompt_file
from tasks.errors import ConfigError, EnvironmentLoadError, PromptFileError

AnyEnvironment = Environment | Agent  # an environment the runner steps, or an agent that runs itself
BUILTIN_ENVIRONMENTS: Mapping[str, type[Environment] | type[Agent]] = {
    Arithmetic.name: Arithmetic,
    GuessNumber.name: GuessNumber,
    Calculator.name: Calculator,
    AgentCommand.name: AgentCommand,
    AgentCallable.name: AgentCallable,
}

CODE_BUILTINS = (AgentCommand.name, AgentCallable.name)  # built-ins whose options name code to run


@dataclass(frozen=True)
class Runnables:
    """What a batch may run: the registry's entries, and whether code may also be named directly.

    ``direct`` is the operator's CLI (commands, callables, import paths and prompt files by path);
    without it (a triggered batch: the Airflow form, its run conf, a profile, and the generate
    workers that run it) only the built-in games and the registry's names load.
    """

    registry: EnvironmentRegistry
    direct: bool

    def __post_init__(self) -> None:
        if taken := sorted(set(self.registry.entries) & set(BUILTIN_ENVIRONMENTS)):
            raise ConfigError(f"environment registry {self.registry.path}: entry name(s) {taken} are built-ins")

    @classmethod
    def operator(cls, path: Path | None = None) -> Runnables:
        return cls(load_registry(path), direct=True)

    @classmethod
    def triggered(cls, path: Path | None = None) -> Runnables:
        return cls(load_registry(path), direct=False)

    def choices(self) -> list[str]:
        """The names a trigger may pick: the built-in games, then the registry's entries."""
        return [n for n in sorted(BUILTIN_ENVIRONMENTS) if n not in CODE_BUILTINS] + sorted(self.registry.entries)

    def check_named(self, spec: str) -> None:
        """Refuse a spec a trigger may not name (the field and the registry file in the message)."""
        if self.direct or spec in self.choices():
            return
        raise ConfigError(
            f"environment {spec!r}: a triggered batch may run only a built-in game or an entry of the deployment's "
            f"environment registry {self.registry.path} (choices: {', '.join(self.choices())}); commands, "
            "callables, import paths and prompt files are declared there by the deployment (docs/security.md)"
        )


def _import_class(spec: str) -> type[Environment] | type[Agent]:
    try:
        candidate = import_object(spec)
    except ImportPathError as error:
        raise EnvironmentLoadError(spec, error.reason, str(error)) from error
    if not (inspect.isclass(candidate) and issubclass(candidate, (Environment, Agent))):
        detail = (
            f"{spec.partition(':')[2]!r} is {candidate!r}, not a subclass of tasks.environments.base.Environment "
            "or tasks.environments.agents.Agent"
        )
        raise EnvironmentLoadError(spec, "not_an_environment", detail)
    if inspect.isabstract(candidate):
        missing = sorted(candidate.__abstractmethods__)
        detail = f"{spec.partition(':')[2]!r} is abstract (missing {missing})"
        raise EnvironmentLoadError(spec, "not_an_environment", detail)
    return candidate


def environment_class(spec: str) -> type[Environment] | type[Agent]:
    """The class a spec names (prompt files: :class:`PromptsFile`), without building it."""
    if not isinstance(spec, str) or not spec:
        raise EnvironmentLoadError(str(spec), "unknown_environment", "the spec must be a non-empty string")
    if is_prompt_file(spec):
        return PromptsFile
    if ":" in spec:
        return _import_class(spec)
    if spec not in BUILTIN_ENVIRONMENTS:
        detail = (
            f"not a built-in ({', '.join(sorted(BUILTIN_ENVIRONMENTS))}), an import path 'pkg.module:Class', "
            f"or a prompt file (supported suffixes: {', '.join(SUFFIXES)})"
        )
        raise EnvironmentLoadError(spec, "unknown_environment", detail)
    return BUILTIN_ENVIRONMENTS[spec]


def load_environment(
    spec: str, options: Mapping[str, Any] | None = None, *, runnables: Runnables | None = None
) -> AnyEnvironment:
    """Build the environment ``spec`` names with ``options`` (for a prompt file, ``path`` defaults to ``spec``).

    ``runnables`` (default: the operator's, :meth:`Runnables.operator`) says what may load. A
    registry name takes the options a trigger may set from ``options`` and the rest from its entry;
    ``options`` that hold more (a batch's recorded ones) must equal what the entry resolves to now.
    """
    runnables = runnables or Runnables.operator()
    runnables.check_named(spec)
    if spec in runnables.registry:
        return _declared(spec, dict(options or {}), runnables)
    return _built(spec, options)


def _declared(name: str, options: dict[str, Any], runnables: Runnables) -> AnyEnvironment:
    registry = runnables.registry
    opened = registry.trigger_set(name, options)
    environment = _built(registry.kind_of(name), registry.options_for(name, opened))
    now = environment.options()  # options beyond the trigger's (a batch's recorded ones) must equal the entry's
    differ = sorted(k for k in options if k not in registry.entries[name].trigger_options and options[k] != now.get(k))
    if differ:
        raise registry.refuse_fixed(name, differ)
    return environment


def _built(spec: str, options: Mapping[str, Any] | None) -> AnyEnvironment:
    cls = environment_class(spec)
    options = dict(options or {})
    if is_prompt_file(spec) and recorded_path(str(options.setdefault("path", spec))) != recorded_path(spec):
        raise EnvironmentLoadError(spec, "bad_options", f"option path {options['path']!r} differs from the spec")
    try:
        return cls(**options)
    except PromptFileError as error:
        raise EnvironmentLoadError(spec, error.reason, str(error)) from error
    except (TypeError, ValueError) as error:
        raise EnvironmentLoadError(spec, "bad_options", f"options {options!r} rejected: {error}") from error
