"""The deployment's registry of runnable environments (``dags/environments.yaml``; docs/security.md).

Who may run what: a deployment manager declares every command, callable, scorer and import-path
environment a triggered batch may run, by name, in the registry file; a person who triggers a
batch (the Airflow form, a run conf, a profile) picks a built-in game or a registry name and may
set only the options the entry opens to triggers, within their declared types and bounds. The
``rollout-ledger`` CLI belongs to an operator on their own machine: it may name commands,
callables and import paths directly, and resolves registry names too.

An entry::

    calculator_agent:
      description: what it is, for the form
      kind: agent_command            # any environment spec: a built-in, pkg.module:Class, a prompt file
      options: {command: ["{python}", "{here}/agent.py"], tasks: tasks.jsonl, timeout_s: 120}
      trigger_options:               # what a trigger may set: type and bounds
        timeout_s: {type: number, minimum: 1, maximum: 600}
      env: [SEARCH_API_KEY]          # agent_command: worker variables the agent receives, by name
      binds: ["{here}", {path: /data/scratch, writable: true}]  # agent_command: what its sandbox shows
      isolation: sandbox             # agent_command: or `process` where no sandbox can start (weaker)

In ``command``, ``{python}`` is the interpreter that runs generate and ``{here}`` the registry
file's folder; a relative ``tasks``, ``path`` or bind is relative to that folder. An agent
command runs in an OS sandbox that shows the system folders, the worker's Python, the files its
command names and its ``binds`` (:mod:`tasks.environments.agent_sandbox`); ``isolation:
process`` runs it as a plain child process where no sandbox can start, and is recorded. The registry is read
where it is used (the DAG parse for the form's choices, plan, and each generate worker), from
``$ROLLOUT_LEDGER_ENVIRONMENTS`` or else this checkout's ``dags/environments.yaml``. A batch
records the entry's name and its resolved options; a worker rebuilds them from its own registry
and refuses a batch whose recorded options differ (the entry changed since plan), so nothing
read from storage is ever run.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tasks.errors import ConfigError
from tasks.ids import ID_PATTERN, MAX_ID_LENGTH

REGISTRY_VARIABLE = "ROLLOUT_LEDGER_ENVIRONMENTS"
REGISTRY_FILE_NAME = "environments.yaml"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PATH_OPTIONS = ("tasks", "path")  # options that name a file: relative ones are relative to the registry's folder


def registry_file(environ: Mapping[str, str] = os.environ) -> Path:
    """``$ROLLOUT_LEDGER_ENVIRONMENTS``, else the ``dags/environments.yaml`` beside this package."""
    if environ.get(REGISTRY_VARIABLE):
        return Path(environ[REGISTRY_VARIABLE])
    return Path(__file__).resolve().parents[2] / "dags" / REGISTRY_FILE_NAME


class TriggerOption(BaseModel):
    """One option a trigger may set: its JSON type, bounds or choices."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    type: Literal["integer", "number", "string", "boolean"]
    minimum: float | None = Field(None, allow_inf_nan=False)
    maximum: float | None = Field(None, allow_inf_nan=False)
    enum: list[Any] | None = None
    max_length: int | None = Field(None, ge=1)
    description: str = ""

    def check(self, name: str, value: Any) -> Any:
        """``value`` when it fits; else a ConfigError naming ``name`` (the option's dotted name) and the rule."""
        fits = {
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
            "string": isinstance(value, str),
            "boolean": isinstance(value, bool),
        }[self.type]
        if fits and self.type in ("integer", "number"):
            fits = (self.minimum is None or value >= self.minimum) and (self.maximum is None or value <= self.maximum)
        if fits and self.type == "string" and self.max_length is not None:
            fits = len(value) <= self.max_length
        if fits and self.enum is not None:
            fits = value in self.enum
        if not fits:
            raise ConfigError(f"{name} must be {self.rule()}, got {value!r}")
        return value

    def rule(self) -> str:
        """The rule in words: ``an integer in [1, 64]``."""
        if self.enum is not None:
            return f"one of {list(self.enum)}"
        text = {"integer": "an integer", "number": "a finite number", "string": "a string", "boolean": "true or false"}
        low, high = (_bound(b) for b in (self.minimum, self.maximum))
        if low is not None and high is not None:
            return f"{text[self.type]} in [{low}, {high}]"
        bounds = [f">= {low}"] if low is not None else []
        bounds += [f"<= {high}"] if high is not None else []
        bounds += [f"of at most {self.max_length} characters"] if self.max_length is not None else []
        return " ".join([text[self.type], *bounds])


def _bound(value: float | None) -> str | None:
    """A bound as people write it: ``1048576``, ``0.5`` (no exponent, no ``.0`` on whole numbers)."""
    if value is None:
        return None
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


class DeclaredEnvironment(BaseModel):
    """One registry entry: the environment it runs, its fixed options, what a trigger may set, what it receives."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: str = Field(min_length=1)
    description: str = ""
    options: dict[str, Any] = Field(default_factory=dict)
    trigger_options: dict[str, TriggerOption] = Field(default_factory=dict)
    env: list[str] = Field(default_factory=list)
    isolation: Literal["sandbox", "process"] | None = None  # agent_command: default sandbox (agent_sandbox.py)
    binds: list[str | Bind] = Field(default_factory=list)  # agent_command: what its sandbox shows

    @field_validator("env")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name")
        return names


class Bind(BaseModel):
    """A folder or file an agent's sandbox shows: ``path`` (relative: to the registry's folder), read-only unless
    ``writable``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    path: str = Field(min_length=1)
    writable: bool = False


AGENT_COMMAND_FIELDS = ("env", "isolation", "binds")  # entry fields only an agent_command has; options of it


@dataclass(frozen=True)
class EnvironmentRegistry:
    """The entries of one registry file, by name."""

    path: Path
    entries: Mapping[str, DeclaredEnvironment]

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def options_for(self, name: str, given: Mapping[str, Any]) -> dict[str, Any]:
        """Entry ``name``'s options with ``given`` ones a trigger may set (each checked); see :meth:`trigger_set`."""
        entry = self.entries[name]
        opened = entry.trigger_options
        checked = {key: opened[key].check(f"environment_options.{key}", value) for key, value in given.items()}
        options = {**self._resolved(entry.options), **checked}
        if entry.env:
            options["env"] = list(entry.env)
        if entry.isolation is not None:
            options["isolation"] = entry.isolation
        if entry.binds:
            options["binds"] = [self._bind(bind) for bind in entry.binds]
        return options

    def kind_of(self, name: str) -> str:
        """Entry ``name``'s environment spec (a relative prompt file path: relative to the registry's folder)."""
        from tasks.environments.prompts_file import is_prompt_file

        kind = self.entries[name].kind
        return self._local(kind) if is_prompt_file(kind) else kind

    def trigger_set(self, name: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """The options among ``options`` that entry ``name`` lets a trigger set (None: unset, the default)."""
        opened = self.entries[name].trigger_options
        return {key: value for key, value in options.items() if key in opened and value is not None}

    def refuse_fixed(self, name: str, differ: list[str]) -> ConfigError:
        """The error for options ``differ`` that entry ``name`` fixes but were given otherwise."""
        opened = sorted(self.entries[name].trigger_options) or "none"
        return ConfigError(
            f"environment_options.{differ[0]}: environment {name!r} is declared in {self.path}, which fixes "
            f"{differ}; a trigger may set only {opened} (a batch planned before the entry changed: plan it again)"
        )

    def _resolved(self, options: Mapping[str, Any]) -> dict[str, Any]:
        here = str(self.path.parent.resolve())
        resolved = dict(options)
        if isinstance(resolved.get("command"), list):
            resolved["command"] = [_placeholders(arg, here) for arg in resolved["command"]]
        for key in PATH_OPTIONS:
            if isinstance(resolved.get(key), str):
                resolved[key] = self._local(resolved[key])
        return resolved

    def _bind(self, bind: str | Bind) -> str | dict[str, Any]:
        """A bind as an agent command's option: its path absolute (``{here}`` and relative paths resolved)."""
        spec = Bind(path=bind) if isinstance(bind, str) else bind
        path = os.path.normpath(self._local(_placeholders(spec.path, str(self.path.parent.resolve()))))
        return {"path": path, "writable": True} if spec.writable else path

    def _local(self, path: str) -> str:
        """``path`` relative to the registry's folder (URLs and absolute paths as they are)."""
        return path if "://" in path or os.path.isabs(path) else str(self.path.parent.resolve() / path)


def _placeholders(arg: Any, here: str) -> Any:
    """``{here}`` in a command argument; a path made with it is normalized. ``{python}`` stays: it is the
    interpreter of the worker that runs the agent (:class:`~tasks.environments.agents.AgentCommand`)."""
    if not isinstance(arg, str):
        return arg
    resolved = arg.replace("{here}", here)
    return os.path.normpath(resolved) if arg.startswith("{here}") else resolved


def load_registry(path: Path | None = None) -> EnvironmentRegistry:
    """The registry at ``path`` (default :func:`registry_file`); an absent file declares nothing.

    A ConfigError names the file and the entry for a file that is not a mapping of entries, an
    entry that does not parse, or a name that is not an id, is a built-in, or reads as an import
    path or prompt file.
    """
    path = path or registry_file()
    try:
        stat = path.stat()
    except FileNotFoundError:
        return EnvironmentRegistry(path, {})
    return _parsed(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _parsed(path: Path, _mtime_ns: int, _size: int) -> EnvironmentRegistry:
    """One parse per version of the file (the DAG processor reads it on every parse)."""
    import yaml

    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"environment registry {path}: cannot be read: {error}") from None
    raw = document.get("environments", {}) if isinstance(document, dict) else None
    if not isinstance(raw, dict) or set(document) - {"environments"}:
        raise ConfigError(f"environment registry {path}: must be a mapping with one key 'environments'")
    entries = {}
    for name, spec in (raw or {}).items():
        _check_name(path, name)
        try:
            entries[name] = DeclaredEnvironment.model_validate(spec)
        except ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'entry'}: {e['msg']}" for e in error.errors(include_url=False)
            )
            raise ConfigError(f"environment registry {path}: entry {name!r}: {problems}") from None
        entry = entries[name]
        given = [field for field in AGENT_COMMAND_FIELDS if getattr(entry, field) not in (None, [])]
        if given and entry.kind != "agent_command":
            raise ConfigError(
                f"environment registry {path}: entry {name!r}: {given} are for agent_command entries only"
            )
    return EnvironmentRegistry(path, entries)


def _check_name(path: Path, name: object) -> None:
    from tasks.environments.prompts_file import is_prompt_file

    if not isinstance(name, str) or len(name) > MAX_ID_LENGTH or not ID_PATTERN.fullmatch(name):
        raise ConfigError(f"environment registry {path}: entry name {name!r} must match {ID_PATTERN.pattern}")
    if is_prompt_file(name):
        raise ConfigError(f"environment registry {path}: entry name {name!r} reads as a prompt file")
