"""Objects named by import path (``package.module:attribute``), with the reason a path names nothing."""

from __future__ import annotations

import importlib


class ImportPathError(ValueError):
    """An import path that names nothing; ``reason`` is one of the environment load reasons."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def import_object(spec: str) -> object:
    """The attribute ``spec`` (``package.module:attribute``) names; else :class:`ImportPathError` saying why."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ImportPathError("bad_import_path", "an import path looks like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name == error.name or module_name.startswith(f"{error.name}.")):
            raise ImportPathError("module_not_found", f"no module named {error.name!r}") from error
        raise ImportPathError("import_failed", f"importing {module_name!r} failed: {error}") from error
    except Exception as error:
        raise ImportPathError("import_failed", f"importing {module_name!r} failed: {error!r}") from error
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ImportPathError("attribute_missing", f"module {module_name!r} has no {attribute!r}") from None
