"""Engine options as pydantic models: one class per engine, its JSON Schema, and errors that name the option.

An engine's options class (:class:`EngineOptions` subclass) declares each option once, with its
type, bounds and description; the declaration is the validation, the JSON Schema
(``model_json_schema()``, served by :func:`tasks.engines.registry.options_schema`) and the wording
of the errors. Validation is strict (``True`` is not an int, ``"8"`` is not a number), an unknown
option is refused, and a built options object is frozen. Every refusal is a ``ValueError`` whose
message names the option: ``unknown vllm engine option(s) ['max_len']; known: [...]`` or
``engine option max_model_len must be an int >= 2 or null, got 1``.

Imports pydantic only: the registry (and through it the Airflow DAG parse) imports these modules.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

# Top logprobs an engine reads per sampled token of a top-p / top-k call to record its kept set (option
# sampling_mask_candidates of the vLLM engines; tasks.engines.sampling_masks).
DEFAULT_MASK_CANDIDATES = 64
MAX_MASK_CANDIDATES = 1024

_NOUNS: Mapping[type, str] = {
    int: "an int",
    float: "a number",
    bool: "true or false",
    str: "a string",
    dict: "a JSON object",
}
_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)


class EngineOptions(BaseModel):
    """Base of an engine's options: strict, frozen, no unknown keys; errors are ValueErrors naming the option."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    engine: ClassVar[str]  # the registry name, for messages
    unknown_hint: ClassVar[str] = ""  # where options that are not fields go, for the unknown-option message

    def __init__(self, **options: Any) -> None:
        try:
            super().__init__(**options)
        except ValidationError as error:
            raise ValueError(type(self).explain(error)) from None

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> typing.Self:
        """Build from a config mapping (``None``: every default); a bad or unknown key is a ValueError naming it."""
        if options is None:
            return cls()
        if not isinstance(options, Mapping) or not all(isinstance(key, str) for key in options):
            raise ValueError(f"{cls.engine} engine options must be a JSON object with string keys, got {options!r}")
        return cls(**options)

    @classmethod
    def explain(cls, error: ValidationError) -> str:
        """One message for every problem pydantic found: unknown options first, then each bad one by name."""
        problems = error.errors(include_url=False)
        unknown = sorted(str(p["loc"][0]) for p in problems if p["type"] == "extra_forbidden")
        messages = []
        if unknown:
            hint = f" ({cls.unknown_hint})" if cls.unknown_hint else ""
            messages.append(f"unknown {cls.engine} engine option(s) {unknown}; known: {sorted(cls.model_fields)}{hint}")
        for problem in problems:
            if problem["type"] == "extra_forbidden":
                continue
            if problem["type"] == "value_error":  # a validator's own message names what is wrong
                messages.append(str(problem["ctx"]["error"]))
                continue
            name = str(problem["loc"][0]) if problem["loc"] else ""
            field = cls.model_fields.get(name)
            requirement = requirement_of(field) if field is not None else problem["msg"]
            messages.append(f"engine option {name} must be {requirement}, got {problem['input']!r}")
        return "; ".join(dict.fromkeys(messages))


def requirement_of(field: FieldInfo) -> str:
    """What a field accepts, in words: ``an int >= 1``, ``a number > 0 and <= 1 or null``, ``one of (...)``."""
    annotation = field.annotation
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = typing.get_args(annotation) if union else (annotation,)
    kinds = [member for member in members if member is not type(None)]
    words = " or ".join(_noun(kind) for kind in kinds)
    bounds = [
        f"{symbol} {getattr(constraint, attribute)}"
        for constraint in field.metadata
        for kind, attribute, symbol in _BOUNDS
        if isinstance(constraint, kind)
    ]
    if bounds:
        words = f"{words} {' and '.join(bounds)}"
    return f"{words} or null" if len(kinds) < len(members) else words


def _noun(kind: Any) -> str:
    if typing.get_origin(kind) is Literal:
        return f"one of {typing.get_args(kind)}"
    return _NOUNS.get(typing.get_origin(kind) or kind, getattr(kind, "__name__", str(kind)))


def read_key_file(path: str | Path, *, what: str) -> str:
    """The secret in the file ``path`` (surrounding whitespace dropped); a ValueError naming ``what`` and the
    file, never its content, when it cannot be read or is empty."""
    file = Path(path).expanduser()
    try:
        key = file.read_text().strip()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {file}: {exc.strerror}") from None
    if not key:
        raise ValueError(f"{what}: {file} is empty")
    return key
