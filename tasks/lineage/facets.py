"""OpenLineage facets of a batch's datasets, built with the OpenLineage client's own classes.

Standard facets: the Arrow schema of a dataset's records (``schema``), row, byte and file counts
(``outputStatistics``), the sha256 a file was pinned at (``version``), a
suite's expectations (``dataQualityAssertions``: name, GX type, success, column, severity, rule,
threshold and observed, as JSON) and its profile (``dataQualityMetrics``). One custom facet,
``rolloutLedgerProvenance`` (:class:`ProvenanceDatasetFacet`): the batch's model reference and
hashes, weight versions, environment, engine and code version; its JSON Schema is
``docs/lineage/provenance-facet.json`` (:data:`PROVENANCE_SCHEMA_URL`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attr
import pyarrow as pa
from openlineage.client.facet_v2 import (
    data_quality_assertions_dataset,
    data_quality_metrics_input_dataset,
    dataset_version_dataset,
    output_statistics_output_dataset,
    schema_dataset,
)
from openlineage.client.generated.base import DatasetFacet

from tasks.config import BatchConfig
from tasks.records.profile_metrics import ProfileMetrics, TableStats
from tasks.records.suite_summary import SuiteSummary
from tasks.validate.suites import ExpectationSpec

PROVENANCE_FACET = "rolloutLedgerProvenance"
DOCS_URL = "https://github.com/rollout-ledger/rollout-ledger/blob/main/docs"
PROVENANCE_SCHEMA_URL = f"{DOCS_URL}/lineage/provenance-facet.json#/$defs/RolloutLedgerProvenanceDatasetFacet"


@attr.define
class ProvenanceDatasetFacet(DatasetFacet):
    """What a batch's data was generated from (docs/lineage.md, "The provenance facet")."""

    batchId: str
    model: dict[str, str]
    weightVersion: int
    environment: dict[str, Any]
    engine: str
    codeVersion: str
    weightVersions: list[int] | None = attr.field(default=None)

    # the model's hashes are not secrets: Airflow's masker would hide ``tokenizer_sha256`` (it has "token")
    _additional_skip_redact: ClassVar[list[str]] = ["model"]

    @staticmethod
    def _get_schema() -> str:
        return PROVENANCE_SCHEMA_URL


def provenance(config: BatchConfig, weight_versions: Sequence[int] | None = None) -> ProvenanceDatasetFacet:
    """The provenance facet of ``config``'s batch; ``weight_versions`` those its data was sampled at, if known."""
    model = config.model
    return ProvenanceDatasetFacet(
        batchId=config.batch_id,
        model={"reference": model.reference, "weights": model.weights, **model.provenance},
        weightVersion=config.weight_version,
        weightVersions=None if weight_versions is None else sorted(set(weight_versions)),
        environment={"name": config.environment, "options": dict(config.environment_options)},
        engine=config.engine.name,
        codeVersion=config.code_version,
    )


def schema(tables: Mapping[str, pa.Schema] | pa.Schema) -> schema_dataset.SchemaDatasetFacet:
    """The fields of one Arrow schema, or of several record kinds (``calls``, ``receipts``...) as nested fields."""
    if isinstance(tables, pa.Schema):
        return schema_dataset.SchemaDatasetFacet(fields=[_field(f) for f in tables])
    return schema_dataset.SchemaDatasetFacet(
        fields=[
            schema_dataset.SchemaDatasetFacetFields(name=name, type="table", fields=[_field(f) for f in kind])
            for name, kind in tables.items()
        ]
    )


def _field(field: pa.Field) -> schema_dataset.SchemaDatasetFacetFields:
    kind = field.type
    item = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else None
    struct = item if item is not None and pa.types.is_struct(item) else kind if pa.types.is_struct(kind) else None
    if struct is None:
        return schema_dataset.SchemaDatasetFacetFields(name=field.name, type=str(kind))
    return schema_dataset.SchemaDatasetFacetFields(
        name=field.name,
        type="list<struct>" if item is not None else "struct",
        fields=[_field(struct.field(i)) for i in range(struct.num_fields)],
    )


def output_statistics(
    *, rows: int, size: int, files: int
) -> output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet:
    return output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
        rowCount=rows, size=size, fileCount=files
    )


def version(sha256: str) -> dataset_version_dataset.DatasetVersionDatasetFacet:
    return dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=sha256)


def assertions(
    summary: SuiteSummary, specs: Sequence[ExpectationSpec]
) -> data_quality_assertions_dataset.DataQualityAssertionsDatasetFacet:
    """Every expectation of a suite run, in report order, with the column it checks where it checks one."""
    spec_of = {spec.name: spec for spec in specs}
    found = []
    for outcome in summary.expectations:
        spec = spec_of.get(outcome.name)
        found.append(
            data_quality_assertions_dataset.Assertion(
                assertion=outcome.expectation,
                success=outcome.success,
                column=None if spec is None else _column(spec),
                severity=outcome.severity,
                name=outcome.name,
                description=None if spec is None else spec.rule,
                expected=None if outcome.threshold is None else json.dumps(outcome.threshold),
                actual=None if outcome.observed is None else json.dumps(outcome.observed),
            )
        )
    return data_quality_assertions_dataset.DataQualityAssertionsDatasetFacet(assertions=found)


def _column(spec: ExpectationSpec) -> str | None:
    """The column an expectation checks (``a,b`` for a pair or a compound key), None for a table rule."""
    kwargs = spec.kwargs
    if "column" in kwargs:
        return str(kwargs["column"])
    if "column_A" in kwargs:
        return f"{kwargs['column_A']},{kwargs['column_B']}"
    if "column_list" in kwargs:
        return ",".join(map(str, kwargs["column_list"]))
    return None


def metrics(
    profile: ProfileMetrics, *, rows: int, size: int, files: int
) -> data_quality_metrics_input_dataset.DataQualityMetricsInputDatasetFacet:
    """The suite's profile as data quality metrics: every profiled column as ``table.column``, with the
    dataset's own ``rows``, bytes and files."""
    return data_quality_metrics_input_dataset.DataQualityMetricsInputDatasetFacet(
        columnMetrics={f"{t.name}.{c}": stats for t in profile.tables for c, stats in _columns(t).items()},
        rowCount=rows,
        bytes=size,
        fileCount=files,
    )


def _columns(table: TableStats) -> dict[str, data_quality_metrics_input_dataset.ColumnMetrics]:
    return {
        column.name: data_quality_metrics_input_dataset.ColumnMetrics(
            nullCount=column.nulls,
            distinctCount=column.distinct,
            sum=column.sum,
            count=float(column.count),
            min=column.min,
            max=column.max,
        )
        for column in table.columns
    }
