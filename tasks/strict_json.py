"""One strict JSON-to-dataclass loader for the project's JSON documents (batch config, markers).

:func:`load_dataclass` builds a frozen dataclass from parsed JSON and refuses what a typo or
a newer writer would slip through: an unknown field, a missing one, a value of the wrong
shape where a dataclass or a tuple is declared. Every error is raised as the caller's error
class and names the path of the offending value (``batch config.sampling.top_k``,
``m.json.files[2]``). Values of other types pass as they are: the dataclass's own
``__post_init__`` checks them, and its errors are re-raised the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def load_dataclass(
    cls: type[T],
    raw: object,
    *,
    source: str,
    error: type[Exception] = ValueError,
    require_all: bool = False,
) -> T:
    """``cls`` built from the parsed JSON ``raw``, nested dataclasses and tuples of them included.

    A field with a default may be omitted unless ``require_all`` (a document written once and
    in full, like a marker, names every field, nested ones included). Raises ``error`` naming
    ``source`` (the path of the value) for a value that is not a JSON object, unknown or missing
    fields, a list where a tuple is declared, and for a ``TypeError`` / ``ValueError`` of the
    constructor; an ``error`` the constructor raises keeps its class and gets the path in front.
    """
    if not isinstance(raw, Mapping):
        raise error(f"{source} must be a JSON object, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise error(f"{source}: unknown field(s) {unknown}")
    missing = sorted(
        name
        for name, f in fields.items()
        if name not in raw
        and (require_all or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING))
    )
    if missing:
        raise error(f"{source}: missing field(s) {missing}")
    hints = _type_hints(cls)
    values = {
        name: _load_value(hints[name], value, source=f"{source}.{name}", error=error, require_all=require_all)
        for name, value in raw.items()
    }
    try:
        return cls(**values)
    except error as exc:
        message = str(exc)
        raise type(exc)(message if message.startswith(source) else f"{source}: {message}") from None
    except (TypeError, ValueError) as exc:
        raise error(f"{source}: {exc}") from None


def dump_document(record: Any) -> str:
    """A dataclass record as a JSON document: its fields in declaration order, two-space indent, trailing newline."""
    return json.dumps(dataclasses.asdict(record), indent=2, allow_nan=False) + "\n"


def load_document(cls: type[T], text: str | bytes, *, source: str, error: type[Exception]) -> T:
    """The record of ``cls`` a JSON document holds, every field named (nested ones too); ``error`` otherwise."""
    return load_dataclass(
        cls, parse_json(text, source=source, error=error), source=source, error=error, require_all=True
    )


def parse_json(text: str | bytes, *, source: str, error: type[Exception] = ValueError) -> Any:
    """The parsed JSON document ``text``; text that is not JSON raises ``error`` naming ``source``."""
    try:
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{source} is not valid JSON: {exc}") from None


def _load_value(hint: Any, value: Any, *, source: str, error: type[Exception], require_all: bool) -> Any:
    """``value`` as the declared type needs it: a dataclass or a tuple built, anything else as it is."""
    if value is None and _allows_none(hint):
        return None
    hint = _without_none(hint)
    if dataclasses.is_dataclass(hint):
        nested: type = hint  # type: ignore[assignment]
        return load_dataclass(nested, value, source=source, error=error, require_all=require_all)
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list):
            raise error(f"{source} must be a list, got {type(value).__name__}")
        args = typing.get_args(hint)
        items = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(items) != len(value):
            raise error(f"{source} must hold {len(items)} items, got {len(value)}")
        return tuple(
            _load_value(item, v, source=f"{source}[{i}]", error=error, require_all=require_all)
            for i, (item, v) in enumerate(zip(items, value, strict=True))
        )
    return value


def _allows_none(hint: Any) -> bool:
    return _is_union(hint) and type(None) in typing.get_args(hint)


def _without_none(hint: Any) -> Any:
    """``X`` of ``X | None`` (a union of several other types is left as it is)."""
    if not _is_union(hint):
        return hint
    others = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return others[0] if len(others) == 1 else hint


def _is_union(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)
