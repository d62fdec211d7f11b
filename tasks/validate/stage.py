"""The two validation stages: ``validate_lineage`` before finalize, ``validate_dataset`` after.

Each stage reads what the batch's markers commit, profiles it with Arrow
(:mod:`~tasks.validate.lineage_profile`, :mod:`~tasks.validate.dataset_profile`), runs its suite with
Great Expectations (:mod:`~tasks.validate.gx_run`) and writes a run directory on the batch's storage
(:mod:`~tasks.validate.suite_runs`): the Data Docs first, then ``profile.json`` (the profile in
numbers), ``summary.json`` last. Re-running a stage
with the same inputs and thresholds returns the current summary without running again.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import pyarrow as pa

from tasks import layout
from tasks.batch import Batch
from tasks.config import BatchConfig, ValidationSpec
from tasks.errors import NothingToValidateError
from tasks.records.suite_summary import DATASET, LINEAGE, SuiteSummary
from tasks.storage.objects import sha256_hex
from tasks.validate.dataset_profile import profile_dataset
from tasks.validate.gx_run import run_gx_suite
from tasks.validate.lineage_profile import failed_share, lineage_inputs, profile_lineage
from tasks.validate.profile_stats import profile_metrics
from tasks.validate.suite_runs import claim_run
from tasks.validate.suites import SuiteSpec, dataset_suite, lineage_suite
from tasks.validate.summary import build_summary


@dataclass(frozen=True)
class SuiteOutcome:
    """What a validation stage did: the run's summary, where it is, and whether this call ran the suite.

    ``summary_path`` is batch-relative; ``report_url`` the full URL of the run's Data Docs index.
    ``created`` is False when an earlier run with the same inputs and thresholds was returned.
    """

    summary: SuiteSummary
    summary_path: str
    report_url: str
    created: bool

    @property
    def status(self) -> str:
        """``passed``, ``warned`` or ``failed``."""
        return self.summary.status

    @property
    def success(self) -> bool:
        """True unless a ``fail`` expectation failed."""
        return self.summary.success


def validate_lineage(batch: Batch, *, thresholds: ValidationSpec | None = None) -> SuiteOutcome:
    """Run the lineage suite over the committed shards' ledgers; ``thresholds`` None: the batch config's.

    Raises :class:`NothingToValidateError` when no shard is committed.
    """
    config = batch.config
    spec = thresholds or config.validation
    inputs = lineage_inputs(batch)
    if not inputs.committed:
        raise NothingToValidateError(
            f"batch {batch.batch_id}: none of its {config.shards} shard(s) has a commit marker; generate them first"
        )

    def suite(tables: Mapping[str, pa.Table]) -> SuiteSpec:  # poisoned_rollout_rate's bound depends on the failed share
        failed = failed_share(tables["rollouts"])
        return lineage_suite(spec, weight_version=config.weight_version, failed_share=failed)

    return _run(batch, LINEAGE, suite, spec, inputs.digests, lambda: profile_lineage(batch, inputs))


def validate_dataset(batch: Batch, *, thresholds: ValidationSpec | None = None) -> SuiteOutcome:
    """Run the dataset suite over the staged dataset; ``thresholds`` None: the batch config's.

    The suite reads the config finalize used (the manifest's: ``on_invalid`` may have been
    overridden). Raises :class:`NothingToValidateError` when the batch has no staged dataset.
    """
    manifest = batch.staged_dataset()
    if manifest is None:
        raise NothingToValidateError(
            f"batch {batch.batch_id} has no staged dataset; run `rollout-ledger finalize` first"
        )
    config = BatchConfig.from_dict(manifest.config, source=f"{batch.url_of(layout.DATASET_STAGED)}: config")
    spec = thresholds or config.validation
    inputs = {layout.DATASET_STAGED: sha256_hex(batch.store.read_bytes(layout.DATASET_STAGED))}
    suite = dataset_suite(spec, on_invalid=config.on_invalid)
    return _run(batch, DATASET, lambda tables: suite, spec, inputs, lambda: profile_dataset(batch, manifest))


def _run(
    batch: Batch,
    name: str,
    suite_of: Callable[[Mapping[str, pa.Table]], SuiteSpec],
    thresholds: ValidationSpec,
    inputs: Mapping[str, str],
    profile: Callable[[], dict[str, pa.Table]],
) -> SuiteOutcome:
    """Return the current run when its key matches; else profile, build the suite (``suite_of`` the profile),
    validate, copy Data Docs, write the summary."""
    gx_version = version("great_expectations")
    store, batch_id = batch.store, batch.batch_id
    run_key = _run_key(name, batch_id, inputs, thresholds, gx_version)
    current = batch.suite_summary(name)
    if current is not None and current.run_key == run_key:
        return _outcome(batch, current, created=False)
    tables = profile()
    suite = suite_of(tables)
    run = claim_run(batch, suite.name, run_key=run_key)
    with tempfile.TemporaryDirectory(prefix=f"rollout-ledger-{suite.name}-docs-") as tmp:
        site = Path(tmp)
        results = run_gx_suite(suite, tables, site_dir=site, run_name=run)
        for path in sorted(p for p in site.rglob("*") if p.is_file()):
            store.write_once(
                f"{layout.suite_run_dir(suite.name, run)}/{path.relative_to(site).as_posix()}", path.read_bytes()
            )
    summary = build_summary(
        suite,
        results,
        batch_id=batch_id,
        rows=tables[suite.rows_table].num_rows,
        thresholds=thresholds,
        gx_version=gx_version,
        report=f"{layout.suite_run_dir(suite.name, run)}/{layout.SUITE_REPORT_NAME}",
        created_at=time.time(),
        run=run,
        run_key=run_key,
        inputs=inputs,
    )
    metrics = profile_metrics(suite.name, tables).to_json()
    store.write_once(layout.suite_profile(suite.name, run), metrics.encode("utf-8"))
    store.write_once(layout.suite_summary(suite.name, run), summary.to_json().encode("utf-8"))
    return _outcome(batch, summary, created=True)


def _outcome(batch: Batch, summary: SuiteSummary, *, created: bool) -> SuiteOutcome:
    return SuiteOutcome(
        summary=summary,
        summary_path=layout.suite_summary(summary.suite, summary.run),
        report_url=batch.url_of(summary.report),
        created=created,
    )


def _run_key(suite: str, batch_id: str, inputs: Mapping[str, str], thresholds: ValidationSpec, gx: str) -> str:
    """sha256 of what identifies a run's outcome: suite, batch, input digests, thresholds, GX version."""
    material = {
        "suite": suite,
        "batch_id": batch_id,
        "inputs": dict(inputs),
        "thresholds": asdict(thresholds),
        "gx": gx,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode("utf-8")).hexdigest()
