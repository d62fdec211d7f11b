"""Validate OpenLineage events against the official OpenLineage JSON Schemas, offline.

The schemas in ``openlineage_spec/`` are unmodified copies of the OpenLineage project's
``spec/OpenLineage.json`` and ``spec/facets/*.json`` (Apache-2.0, see that folder's README).
``validate_event`` checks an event dict, as ``openlineage.client.serde.Serde.to_dict`` produces it,
against the core ``RunEvent`` definition and checks each facet against the schema its ``_schemaURL``
names, when that schema is vendored here or is one of the project's (``docs/lineage/``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_DIR = Path(__file__).parent / "openlineage_spec"
# the project's own facet schemas, published in its docs: validated the same way
PROJECT_SCHEMAS = (Path(__file__).parents[2] / "docs" / "lineage" / "provenance-facet.json",)
CORE_SCHEMA_ID = "https://openlineage.io/spec/2-0-2/OpenLineage.json"
RUN_EVENT_REF = f"{CORE_SCHEMA_ID}#/$defs/RunEvent"


@cache
def spec_registry() -> Registry:
    """A registry of every vendored schema and the project's own, keyed by ``$id`` (Draft 2020-12 resources)."""
    resources: list[tuple[str, Resource[Any]]] = []
    for path in [*sorted(SPEC_DIR.glob("*.json")), *PROJECT_SCHEMAS]:
        contents = json.loads(path.read_text(encoding="utf-8"))
        resources.append((contents["$id"], Resource.from_contents(contents, default_specification=DRAFT202012)))
    return Registry().with_resources(resources).crawl()


def _validator(schema: Mapping[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        schema, registry=spec_registry(), format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


def _facets(event: Mapping[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """Yield ``(where, facet name, facet)`` for every facet of a run event."""
    containers: list[tuple[str, Any]] = [
        ("run.facets", event.get("run", {}).get("facets")),
        ("job.facets", event.get("job", {}).get("facets")),
    ]
    for side, extra in (("inputs", "inputFacets"), ("outputs", "outputFacets")):
        for i, dataset in enumerate(event.get(side) or []):
            containers.append((f"{side}[{i}].facets", dataset.get("facets")))
            containers.append((f"{side}[{i}].{extra}", dataset.get(extra)))
    for where, facets in containers:
        for name, facet in (facets or {}).items():
            yield where, name, facet


def _facet_ref(registry: Registry, schema_url: str) -> str:
    """The reference to validate one facet against: the URL itself when it has a fragment, else the
    facet document's only top-level property (a whole facet document describes a facets object)."""
    document, _, fragment = schema_url.partition("#")
    if fragment:
        return schema_url
    properties = registry[document].contents.get("properties", {})
    if len(properties) != 1:
        raise ValueError(f"{schema_url} names no single facet; give a fragment such as #/$defs/<Facet>")
    (key,) = properties
    return f"{document}#/properties/{key.replace('~', '~0').replace('/', '~1')}"


def validate_event(event: dict) -> list[str]:
    """Validate a serialized OpenLineage run event and its facets against the vendored schemas.

    Raises ``jsonschema.ValidationError`` on the first violation. A facet (or the event itself) whose
    ``_schemaURL`` (``schemaURL``) names a schema not vendored here is not checked against it; such URLs
    are returned, sorted and deduplicated, so callers can decide whether that is acceptable. A vendored
    ``_schemaURL`` without a fragment must name a document that describes exactly one facet (else ValueError).
    """
    registry = spec_registry()
    unvendored: set[str] = set()

    _validator({"$ref": RUN_EVENT_REF}).validate(event)
    event_schema = event["schemaURL"].partition("#")[0]
    if event_schema not in registry:
        unvendored.add(event["schemaURL"])

    for where, name, facet in _facets(event):
        schema_url = facet.get("_schemaURL") if isinstance(facet, Mapping) else None
        if not isinstance(schema_url, str):
            continue  # the core schema already rejected it: every facet needs a string _schemaURL
        if schema_url.partition("#")[0] not in registry:
            unvendored.add(schema_url)
            continue
        try:
            _validator({"$ref": _facet_ref(registry, schema_url)}).validate(facet)
        except jsonschema.ValidationError as error:
            error.message = f"{where}.{name} ({schema_url}): {error.message}"
            raise
    return sorted(unvendored)
