"""What each task of a batch reads and writes, as OpenLineage input and output datasets with their facets.

One function per task of ``rollout_batch`` (the CLI runs the same steps): each reads only what
the batch's config, markers, suite summaries and review record commit, after the step did its
work. The graph they form, for a batch of two shards::

    model ─┐                ┌─> ledger/shard-N ──┬─> validate_lineage ─> reports/lineage
    task file ─> plan ─> plan ─> generate[N] ─┤  └─> finalize ─> dataset ─> validate_dataset ─> reports/dataset
           └──────────────> └─> staging/shard-N ─┘                   └─> review, publish ─> dataset

Every dataset the batch writes carries the provenance facet; the validated inputs of a suite
carry its assertions and its profile. A suite checks every committed shard together: each shard
ledger carries the whole suite's assertions and profile columns, with its own row, byte and
file counts.

A shard ledger's rows are calls, counted two ways by its marker: as an output of generate, the
calls its receipted rollouts use (``calls_used``: unknown, so left out, for a version-1 marker);
as an input the lineage suite checked, every call record it names (``calls_recorded``: the suite
checks those no rollout uses too).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from openlineage.client.event_v2 import InputDataset, OutputDataset
from openlineage.client.facet_v2 import output_statistics_output_dataset
from openlineage.client.generated.base import DatasetFacet, InputDatasetFacet, OutputDatasetFacet

from tasks import layout
from tasks.batch import Batch
from tasks.config import BatchConfig, ValidationSpec
from tasks.lineage import facets
from tasks.lineage.naming import (
    DatasetName,
    batch_object,
    model,
    name_of_url,
    server,
    shard_ledger,
    shard_staging,
)
from tasks.records.dataset_row import DatasetRow
from tasks.records.ledger import CallRecord, FailureRow, Receipt, StagedDelta
from tasks.records.planned import PlannedRollout
from tasks.records.suite_summary import DATASET, LINEAGE, SuiteSummary
from tasks.storage.dataset_manifest import DatasetMarker
from tasks.storage.marker import ShardMarker
from tasks.validate.suites import dataset_suite, lineage_suite

TASK_FILE_OPTIONS = ("path", "tasks")  # environment options that name the file a batch's tasks come from
LEDGER_SCHEMA = {
    "calls": CallRecord.arrow_schema(),
    "failures": FailureRow.arrow_schema(),
    "receipts": Receipt.arrow_schema(),
}


@dataclass(frozen=True)
class TaskLineage:
    """A task's inputs and outputs, facets included."""

    inputs: tuple[InputDataset, ...] = ()
    outputs: tuple[OutputDataset, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs)

    @classmethod
    def merged(cls, lineages: Iterable[TaskLineage]) -> TaskLineage:
        """Several tasks' datasets as one (the CLI generates many shards at once): each dataset once, first kept."""
        found = list(lineages)
        return cls(
            inputs=tuple(_unique(d for lineage in found for d in lineage.inputs).values()),
            outputs=tuple(_unique(d for lineage in found for d in lineage.outputs).values()),
        )


D = TypeVar("D", InputDataset, OutputDataset)


def _unique(datasets: Iterable[D]) -> dict[tuple[str, str], D]:
    unique: dict[tuple[str, str], D] = {}
    for dataset in datasets:
        unique.setdefault((dataset.namespace, dataset.name), dataset)
    return unique


def plan_lineage(batch: Batch) -> TaskLineage:
    config = batch.config
    sizes = [batch.store.size(layout.plan_config())]
    sizes += [batch.store.size(layout.plan_shard(shard)) for shard in range(config.shards)]
    stats = facets.output_statistics(rows=config.num_rollouts, size=sum(sizes), files=len(sizes))
    plan = _output(_plan_name(batch), {"schema": facets.schema(PlannedRollout.arrow_schema())}, config, stats)
    return TaskLineage(inputs=_sources(config), outputs=(plan,))


def generate_lineage(batch: Batch, shard: int) -> TaskLineage:
    config, marker = batch.config, batch.shard_marker(shard)
    ledger_facets: dict[str, DatasetFacet] = {"schema": facets.schema(LEDGER_SCHEMA)}
    staging_facets: dict[str, DatasetFacet] = {"schema": facets.schema(StagedDelta.arrow_schema())}
    ledger = _output(shard_ledger(batch, shard), ledger_facets, config, _ledger_statistics(marker))
    staging = _output(shard_staging(batch, shard), staging_facets, config, _staging_statistics(marker))
    return TaskLineage(inputs=(_input(_plan_name(batch)), *_sources(config)), outputs=(ledger, staging))


def suite_lineage(batch: Batch, summary: SuiteSummary) -> TaskLineage:
    """A suite run: its inputs with the run's assertions and profile, its report as the output."""
    profile = batch.suite_profile(summary)
    if summary.suite == LINEAGE:
        thresholds = ValidationSpec.of_recorded(summary.thresholds)
        specs = lineage_suite(thresholds, weight_version=batch.config.weight_version).expectations
        assertions = facets.assertions(summary, specs)
        inputs = []
        for shard, marker in _committed(batch).items():
            ledger = [f for f in marker.files if f.kind in layout.LEDGER_KINDS]
            checked: dict[str, InputDatasetFacet] = {"dataQualityAssertions": assertions}
            if profile is not None:
                size, rows = sum(f.size for f in ledger), marker.counts.calls_recorded  # every row it checked
                checked["dataQualityMetrics"] = facets.metrics(profile, rows=rows, size=size, files=len(ledger))
            inputs.append(_input(shard_ledger(batch, shard), input_facets=checked))
    else:
        manifest = batch.staged_dataset()
        on_invalid = manifest.config["on_invalid"] if manifest else batch.config.on_invalid
        specs = dataset_suite(ValidationSpec.of_recorded(summary.thresholds), on_invalid=on_invalid).expectations
        checked = {"dataQualityAssertions": facets.assertions(summary, specs)}
        if profile is not None and manifest is not None:
            size, files = sum(p.size for p in manifest.parts), len(manifest.parts)
            checked["dataQualityMetrics"] = facets.metrics(profile, rows=manifest.rows, size=size, files=files)
        inputs = [_input(_dataset_name(batch), input_facets=checked)]
    report = OutputDataset(*batch_object(batch, layout.suite_dir(summary.suite)))
    return TaskLineage(inputs=tuple(inputs), outputs=(report,))


def finalize_lineage(batch: Batch) -> TaskLineage:
    shards = _committed(batch)
    inputs = [_input(name(batch, shard)) for shard in shards for name in (shard_ledger, shard_staging)]
    return TaskLineage(inputs=(_input(_plan_name(batch)), *inputs), outputs=_dataset(batch, batch.staged_dataset()))


def review_lineage(batch: Batch) -> TaskLineage:
    """The review reads the staged dataset and the suites' reports, and writes the decision record."""
    reports = [_input(batch_object(batch, layout.suite_dir(suite))) for suite in (LINEAGE, DATASET)]
    decision = OutputDataset(*batch_object(batch, layout.REVIEW_RECORD))
    return TaskLineage(inputs=(_input(_dataset_name(batch)), *reports), outputs=(decision,))


def publish_lineage(batch: Batch) -> TaskLineage:
    """Publish commits the validated dataset: the same dataset, now with its committed marker."""
    reports = [_input(batch_object(batch, layout.suite_dir(suite))) for suite in (LINEAGE, DATASET)]
    return TaskLineage(
        inputs=(_input(_dataset_name(batch)), *reports), outputs=_dataset(batch, batch.published_dataset())
    )


def sweep_lineage(batch: Batch, shards: Iterable[int] | None = None) -> TaskLineage:
    """The sweep reads the ledger and staged segments of each committed shard of ``shards`` (default: all),
    deleting what no marker names."""
    committed = _committed(batch)
    shards = list(committed) if shards is None else [s for s in shards if s in committed]
    return TaskLineage(inputs=tuple(_input(name(batch, s)) for s in shards for name in (shard_ledger, shard_staging)))


def _dataset(batch: Batch, manifest: DatasetMarker | None) -> tuple[OutputDataset, ...]:
    if manifest is None:
        return ()
    metrics = batch.dataset_metrics(manifest)
    versions = [int(v) for v in metrics.get("group_weight_versions", {})]
    stats = facets.output_statistics(
        rows=manifest.rows, size=sum(p.size for p in manifest.parts), files=len(manifest.parts)
    )
    config = BatchConfig.from_dict(manifest.config, source=batch.url_of(layout.DATASET_STAGED))
    dataset_facets: dict[str, DatasetFacet] = {"schema": facets.schema(DatasetRow.arrow_schema())}
    return (_output(_dataset_name(batch), dataset_facets, config, stats, versions),)


def _sources(config: BatchConfig) -> tuple[InputDataset, ...]:
    """The model (and the servers the engine calls for it), and the task or prompt file the environment
    reads, if any, each with the sha256 the plan pinned."""
    weights = config.model.weights_sha256
    sources = [_input(model(config.model.reference), {"version": facets.version(weights)} if weights else {})]
    engine = config.engine.options
    served = engine.get("served_model") or config.model.reference
    sources += [_input(server(url, served)) for url in engine.get("urls") or () if isinstance(url, str)]
    options = config.environment_options
    for option in TASK_FILE_OPTIONS:
        if isinstance(options.get(option), str):
            pinned = {"version": facets.version(options["sha256"])} if isinstance(options.get("sha256"), str) else {}
            sources.append(_input(name_of_url(options[option]), pinned))
    return tuple(sources)


def _ledger_statistics(marker: ShardMarker | None) -> OutputDatasetFacet | None:
    """A committed ledger's rows are the calls its receipted rollouts use (``calls_used``), not every call record
    it names; a version-1 marker did not record them, so its row count is left out (unknown)."""
    if marker is None:
        return None
    files = [f for f in marker.files if f.kind in layout.LEDGER_KINDS]
    size = sum(f.size for f in files)
    if marker.counts.calls_used is None:
        return output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(size=size, fileCount=len(files))
    return facets.output_statistics(rows=marker.counts.calls_used, size=size, files=len(files))


def _staging_statistics(marker: ShardMarker | None) -> OutputDatasetFacet | None:
    if marker is None:
        return None
    files = [f for f in marker.files if f.kind == "staging"]
    return facets.output_statistics(rows=marker.counts.staged_rows, size=sum(f.size for f in files), files=len(files))


def _committed(batch: Batch) -> dict[int, ShardMarker]:
    """The commit marker of every committed shard, by shard."""
    markers = {shard: batch.shard_marker(shard) for shard in range(batch.config.shards)}
    return {shard: marker for shard, marker in markers.items() if marker is not None}


def _plan_name(batch: Batch) -> DatasetName:
    return batch_object(batch, "plan")


def _dataset_name(batch: Batch) -> DatasetName:
    return batch_object(batch, layout.DATASET_DIR)


def _input(
    name: DatasetName,
    dataset_facets: dict[str, DatasetFacet] | None = None,
    input_facets: dict[str, InputDatasetFacet] | None = None,
) -> InputDataset:
    return InputDataset(name.namespace, name.name, facets=dataset_facets or {}, inputFacets=input_facets or {})


def _output(
    name: DatasetName,
    dataset_facets: dict[str, DatasetFacet],
    config: BatchConfig,
    statistics: OutputDatasetFacet | None,
    weight_versions: list[int] | None = None,
) -> OutputDataset:
    """An output the batch wrote: its facets plus the batch's provenance, and its statistics when known."""
    described = {**dataset_facets, facets.PROVENANCE_FACET: facets.provenance(config, weight_versions)}
    return OutputDataset(
        name.namespace,
        name.name,
        facets=described,
        outputFacets={"outputStatistics": statistics} if statistics is not None else {},
    )
