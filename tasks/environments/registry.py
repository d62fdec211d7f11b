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

import difflib
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.environments.agents import Agent, AgentCallable, AgentCommand
from tasks.environments.arithmetic import Arithmetic
from tasks.environments.base import Environment
from tasks.environments.calculator import Calculator
from tasks.environments.declared import REGISTRY_VARIABLE, EnvironmentRegistry, load_registry
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


def environment_class(spec: str, registry: EnvironmentRegistry | None = None) -> type[Environment] | type[Agent]:
    """The class a spec names (prompt files: :class:`PromptsFile`), without building it.

    An unknown name is refused naming what a spec may be, with the closest name; given the
    ``registry`` that was read, its file and entries too.
    """
    if not isinstance(spec, str) or not spec:
        raise EnvironmentLoadError(str(spec), "unknown_environment", "the spec must be a non-empty string")
    if is_prompt_file(spec):
        return PromptsFile
    if ":" in spec:
        return _import_class(spec)
    if spec not in BUILTIN_ENVIRONMENTS:
        raise EnvironmentLoadError(spec, "unknown_environment", _unknown_detail(spec, registry))
    return BUILTIN_ENVIRONMENTS[spec]


def _unknown_detail(spec: str, registry: EnvironmentRegistry | None) -> str:
    names = sorted(BUILTIN_ENVIRONMENTS) + (sorted(registry.entries) if registry is not None else [])
    closest = difflib.get_close_matches(spec, names, n=1, cutoff=0.6)
    entries = f", an entry of the environment registry {registry_source(registry)}" if registry is not None else ""
    return (
        f"not a built-in ({', '.join(sorted(BUILTIN_ENVIRONMENTS))}){entries}, an import path 'pkg.module:Class', "
        f"or a prompt file (supported suffixes: {', '.join(SUFFIXES)})"
        + (f"; did you mean {closest[0]!r}?" if closest else "")
    )


def registry_source(registry: EnvironmentRegistry) -> str:
    """The registry file, why that one and its entries: ``/x/envs.yaml (from $ROLLOUT_LEDGER_ENVIRONMENTS;
    entries: a, b)``."""
    named = os.environ.get(REGISTRY_VARIABLE)
    how = (
        f"from ${REGISTRY_VARIABLE}"
        if named and Path(named) == registry.path
        else f"the default: ${REGISTRY_VARIABLE} is unset"
    )
    if not registry.path.is_file():
        return f"{registry.path} ({how}; no such file, so no entries)"
    return f"{registry.path} ({how}; entries: {', '.join(sorted(registry.entries)) or 'none'})"


def accepted_options(cls: type[Environment] | type[Agent]) -> list[str] | None:
    """The option names ``cls`` takes: its constructor's keyword parameters and, where it takes ``**options``,
    those of the constructors after it in the MRO it passes them on to; ``None`` when no constructor declares
    them (``Environment``'s takes none)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        if klass is Environment:  # its **options means none: it refuses any
            return sorted(names)
        if klass is object:
            return None
        parameters = list(inspect.signature(init).parameters.values())[1:]  # after self
        kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names |= {p.name for p in parameters if p.kind in kinds}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return sorted(names)
    return None


def _required_options(cls: type[Environment] | type[Agent]) -> list[str]:
    """The options a constructor of ``cls`` (walked as :func:`accepted_options` does) has no default for."""
    required = set()
    for klass in cls.__mro__:
        if klass in (Environment, object):
            break
        init = vars(klass).get("__init__")
        for p in list(inspect.signature(init).parameters.values())[1:] if init is not None else []:
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty:
                required.add(p.name)
    return sorted(required)


def options_problem(given: Mapping[str, Any], accepted: list[str], required: list[str], takes: str) -> str | None:
    """``unknown option 'high' (did you mean 'hi'?); <takes>`` or ``missing option 'command'; <takes>``; None when
    every given option is accepted and every required one given."""
    unknown = [name for name in given if name not in accepted]
    missing = [name for name in required if name not in given]
    if unknown:
        named = []
        for name in unknown:
            closest = difflib.get_close_matches(str(name), accepted, n=1, cutoff=0.5)
            named.append(f"{name!r}" + (f" (did you mean {closest[0]!r}?)" if closest else ""))
        return f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(named)}; {takes}"
    if missing:
        return f"missing option{'s' if len(missing) > 1 else ''} {', '.join(repr(m) for m in missing)}; {takes}"
    return None


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
    return _built(spec, options, runnables.registry)


def _declared(name: str, options: dict[str, Any], runnables: Runnables) -> AnyEnvironment:
    registry = runnables.registry
    opened = registry.trigger_set(name, options)
    environment = _built(registry.kind_of(name), registry.options_for(name, opened))
    now = environment.options()  # options beyond the trigger's (a batch's recorded ones) must equal the entry's
    opened = registry.entries[name].trigger_options
    unknown = {k: v for k, v in options.items() if k not in opened and k not in now}
    if unknown:  # not an option of the entry at all: name those a trigger may set
        takes = f"entry {name!r} of the environment registry {registry.path} lets a trigger set " + (
            ", ".join(sorted(opened)) or "none of its options"
        )
        raise EnvironmentLoadError(name, "bad_options", options_problem(unknown, sorted(opened), [], takes) or takes)
    differ = sorted(k for k in options if k not in opened and options[k] != now.get(k))
    if differ:
        raise registry.refuse_fixed(name, differ)
    return environment


def _built(spec: str, options: Mapping[str, Any] | None, registry: EnvironmentRegistry | None = None) -> AnyEnvironment:
    cls = environment_class(spec, registry)
    options = dict(options or {})
    if is_prompt_file(spec) and recorded_path(str(options.setdefault("path", spec))) != recorded_path(spec):
        raise EnvironmentLoadError(spec, "bad_options", f"option path {options['path']!r} differs from the spec")
    try:
        return cls(**options)
    except PromptFileError as error:
        raise EnvironmentLoadError(spec, error.reason, str(error)) from error
    except TypeError as error:  # an option the constructor does not take, or one it needs: name what it takes
        accepted, problem = accepted_options(cls), None
        if accepted is not None:
            what = spec if spec in BUILTIN_ENVIRONMENTS else cls.name
            takes = f"{what} accepts: {', '.join(accepted)}" if accepted else f"{what} takes no options"
            problem = options_problem(options, accepted, _required_options(cls), takes)
        raise EnvironmentLoadError(spec, "bad_options", problem or f"options {options!r} rejected: {error}") from error
    except ValueError as error:
        raise EnvironmentLoadError(spec, "bad_options", f"options {options!r} rejected: {error}") from error
