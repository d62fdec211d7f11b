"""Loading an environment from the batch config's spec: a built-in name, ``pkg.module:Class``, or a prompt file.

Resolution order: a spec ending in ``.parquet`` / ``.jsonl`` / ``.json`` is a prompt file (its
path becomes the ``path`` option); a spec containing ``:`` is an import path whose attribute
must be an :class:`Environment` subclass; anything else must be a built-in name. Every failure
is an :class:`EnvironmentLoadError` whose ``reason`` is one of :data:`tasks.errors.ENVIRONMENT_LOAD_REASONS`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from tasks.environments.arithmetic import Arithmetic
from tasks.environments.base import Environment
from tasks.environments.calculator import Calculator
from tasks.environments.guess_number import GuessNumber
from tasks.environments.prompts_file import SUFFIXES, PromptsFile, is_prompt_file, recorded_path
from tasks.errors import EnvironmentLoadError, PromptFileError

BUILTIN_ENVIRONMENTS: Mapping[str, type[Environment]] = {
    Arithmetic.name: Arithmetic,
    GuessNumber.name: GuessNumber,
    Calculator.name: Calculator,
}


def _import_class(spec: str) -> type[Environment]:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise EnvironmentLoadError(spec, "bad_import_path", "an import path looks like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name == error.name or module_name.startswith(f"{error.name}.")):
            raise EnvironmentLoadError(spec, "module_not_found", f"no module named {error.name!r}") from error
        raise EnvironmentLoadError(spec, "import_failed", f"importing {module_name!r} failed: {error}") from error
    except Exception as error:
        raise EnvironmentLoadError(spec, "import_failed", f"importing {module_name!r} failed: {error!r}") from error
    try:
        candidate = getattr(module, attribute)
    except AttributeError:
        raise EnvironmentLoadError(spec, "attribute_missing", f"module {module_name!r} has no {attribute!r}") from None
    if not (inspect.isclass(candidate) and issubclass(candidate, Environment)):
        detail = f"{attribute!r} is {candidate!r}, not a subclass of tasks.environments.base.Environment"
        raise EnvironmentLoadError(spec, "not_an_environment", detail)
    if inspect.isabstract(candidate):
        missing = sorted(candidate.__abstractmethods__)
        raise EnvironmentLoadError(spec, "not_an_environment", f"{attribute!r} is abstract (missing {missing})")
    return candidate


def environment_class(spec: str) -> type[Environment]:
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


def load_environment(spec: str, options: Mapping[str, Any] | None = None) -> Environment:
    """Build the environment ``spec`` names with ``options`` (for a prompt file, ``path`` defaults to ``spec``)."""
    cls = environment_class(spec)
    options = dict(options or {})
    if is_prompt_file(spec) and recorded_path(str(options.setdefault("path", spec))) != recorded_path(spec):
        raise EnvironmentLoadError(spec, "bad_options", f"option path {options['path']!r} differs from the spec")
    try:
        return cls(**options)
    except PromptFileError as error:
        raise EnvironmentLoadError(spec, "bad_prompt_file", str(error)) from error
    except (TypeError, ValueError) as error:
        raise EnvironmentLoadError(spec, "bad_options", f"options {options!r} rejected: {error}") from error
