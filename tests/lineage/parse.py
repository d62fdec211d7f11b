"""Parse emitted OpenLineage events back into the OpenLineage client's own classes.

The client serializes (``Serde``) but has no parser: :func:`parse_event` rebuilds a
``RunEvent`` from its JSON, field by field, through the attrs classes' declared types. Each facet
becomes the facet class whose ``_schemaURL`` it carries: one of the client's generated facets or
this project's. A facet that declares only a base schema of the spec (the Airflow provider's
``airflow``, ``airflowState``... say ``#/$defs/RunFacet``) becomes that base class with its fields
as additional properties, the client's way of carrying custom facets. A facet of any other schema,
a missing field or an unknown one raises, so an event that parses is made of known classes only.
"""

from __future__ import annotations

import importlib
import pkgutil
import types
import typing
from enum import Enum
from functools import cache
from typing import Any

import attr
from openlineage.client import generated
from openlineage.client.event_v2 import RunEvent
from openlineage.client.generated.base import BaseFacet

from tasks.lineage.facets import ProvenanceDatasetFacet


@cache
def facet_classes() -> dict[str, type[BaseFacet]]:
    """Every facet class of the client's generated modules and of this project, by its ``_schemaURL``."""
    found: dict[str, type[BaseFacet]] = {}
    for module in pkgutil.iter_modules(generated.__path__):
        loaded = importlib.import_module(f"{generated.__name__}.{module.name}")
        for value in vars(loaded).values():
            if isinstance(value, type) and issubclass(value, BaseFacet) and value.__module__ == loaded.__name__:
                found[value._get_schema()] = value
    found[ProvenanceDatasetFacet._get_schema()] = ProvenanceDatasetFacet
    return found


def _facet(value: dict[str, Any], where: str) -> BaseFacet:
    schema_url = value.get("_schemaURL", "")
    cls = facet_classes().get(schema_url)
    if cls is None:
        raise ValueError(f"{where}: no client class has the facet schema {schema_url!r}")
    if cls.__module__ != f"{generated.__name__}.base":
        return _attrs(cls, value, where)
    extra = {k: v for k, v in value.items() if k not in ("_producer", "_schemaURL")}  # a custom facet on a base schema
    return cls(producer=value["_producer"]).with_additional_properties(**extra)


def parse_event(data: dict[str, Any]) -> RunEvent:
    """``data`` (one JSON event) as a ``RunEvent`` of the client's classes; ValueError for anything unknown."""
    event = _build(RunEvent, data, "event")
    assert isinstance(event, RunEvent)
    return event


def _build(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if value is None:
            return None
        return _build(options[0], value, where) if len(options) == 1 else value
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_build(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(hint)
        return {k: _build(item, v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, BaseFacet):
        return _facet(value, where)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(value)
    if attr.has(hint):
        return _attrs(hint, value, where)
    return value


def _attrs(cls: type, value: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name.lstrip("_"): f for f in attr.fields(cls)}
    unknown = sorted(set(value) - {f.name for f in attr.fields(cls)} - set(fields))
    if unknown:
        raise ValueError(f"{where}: {cls.__name__} has no field(s) {unknown}")
    kwargs = {}
    for name, field in fields.items():
        key = field.name if field.name in value else name
        if key not in value:
            if field.default is attr.NOTHING:
                raise ValueError(f"{where}: {cls.__name__} misses {field.name}")
            continue
        if field.init:
            kwargs[name if field.name.startswith("_") else field.name] = _build(
                hints[field.name], value[key], f"{where}.{key}"
            )
    return cls(**kwargs)
