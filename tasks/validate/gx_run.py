"""Run a suite's expectations over its profile tables with Great Expectations Core, and build its Data Docs.

One ephemeral context per run (nothing is written to a ``gx/`` folder; analytics off), one
pandas data source with a dataframe asset per profile table, one GX suite and validation
definition per table (``lineage.calls``, ...), each run with its table's id column as the index
of offending rows (``result_format`` SUMMARY with ``unexpected_index_column_names``: the first
:data:`PARTIAL_UNEXPECTED` of them, so a rate broken by many rows keeps results and Data Docs
small). The validation results land in the context's in-memory store, from which Data Docs are
built, in this process, into ``site_dir`` (a ``TupleFilesystemStoreBackend``) with their CDN assets
replaced by vendored copies (:mod:`~tasks.validate.data_docs`); the caller copies that tree to the
batch's storage. GX is imported by :func:`_load_gx` when :func:`run_gx_suite` first
runs, never when :mod:`tasks.validate` is imported.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tasks.validate.data_docs import localize_site
from tasks.validate.suites import ExpectationSpec, SuiteSpec

MAX_EXAMPLES = 5
PARTIAL_UNEXPECTED = 20  # offending rows GX keeps per expectation (the examples are the first of them)
INT64_MAX = 2**63 - 1
# Severity as GX names it (shown in Data Docs); ours decides the suite's status.
GX_SEVERITY = {"fail": "critical", "warn": "warning"}


@dataclass(frozen=True)
class ExpectationResult:
    """What GX found for one expectation: success, rows checked and broken, a few offending ids, or its error."""

    success: bool
    checked: int
    unexpected_count: int
    examples: tuple[str, ...]
    error: str | None

    @property
    def unexpected_rate(self) -> float | None:
        return self.unexpected_count / self.checked if self.checked else None


def run_gx_suite(
    suite: SuiteSpec, tables: Mapping[str, pa.Table], *, site_dir: Path, run_name: str
) -> dict[str, ExpectationResult]:
    """Validate every expectation of ``suite`` over ``tables`` (name → profile table) and build Data Docs.

    Returns each expectation's result by name. An expectation that raises inside GX is a failed
    result carrying the error message, never an exception here.
    """
    gx = _load_gx()
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.expectations.registry import get_expectation_impl

    context = gx.get_context(mode="ephemeral", project_config=_project_config(site_dir))
    source = context.data_sources.add_pandas(suite.name)
    run_id = RunIdentifier(run_name=run_name, run_time=datetime.datetime.now(datetime.UTC))
    results: dict[str, ExpectationResult] = {}
    for table in suite.tables:
        specs = [spec for spec in suite.expectations if spec.table == table.name]
        if not specs:
            continue
        gx_suite = context.suites.add(gx.ExpectationSuite(name=f"{suite.name}.{table.name}"))
        for spec in specs:
            gx_suite.add_expectation(get_expectation_impl(spec.expectation)(**_arguments(spec)))
        batch = source.add_dataframe_asset(table.name).add_batch_definition_whole_dataframe(table.name)
        definition = context.validation_definitions.add(
            gx.ValidationDefinition(name=f"{suite.name}.{table.name}", data=batch, suite=gx_suite)
        )
        validation = definition.run(
            batch_parameters={"dataframe": _frame(tables[table.name])},
            result_format={
                "result_format": "SUMMARY",
                "unexpected_index_column_names": [table.index_column],
                "partial_unexpected_count": PARTIAL_UNEXPECTED,
                "return_unexpected_index_query": False,
            },
            run_id=run_id,
        )
        by_name = {spec.name: spec for spec in specs}
        for found in validation.results:
            name = found.expectation_config.meta["name"]
            results[name] = _result(found, table.index_column, values=by_name[name].examples == "values")
    context.build_data_docs(site_names=[_SITE])
    localize_site(site_dir)
    missing = [spec.name for spec in suite.expectations if spec.name not in results]
    if missing:
        raise RuntimeError(f"suite {suite.name}: GX returned no result for {missing}")
    return results


_SITE = "rollout_ledger"


def _load_gx() -> Any:
    """Import GX (seconds, once per process), register the custom expectations, and return the module.

    GX fingerprints every in-memory frame under 1 GB (an md5 over pandas' row hashes, kept only in
    the batch markers); the profiles are built here from objects already checked by sha256, and
    that fingerprint cost about a second of validation at 10^8 tokens, so it is switched off.
    """
    # 1.24.1 has no usage-statistics code left (the context config says so too); older 1.x read this.
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    import great_expectations as gx
    from great_expectations.execution_engine import pandas_execution_engine

    import tasks.validate.expectations  # noqa: F401  (registers the custom expectations)

    pandas_execution_engine.HASH_THRESHOLD = 0  # GX hashes a frame only when its memory is below this
    return gx


def _project_config(site_dir: Path) -> Any:
    """An in-memory context whose only Data Docs site is ``site_dir``; no progress bars, no analytics."""
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    site = {
        "class_name": "SiteBuilder",
        "show_how_to_buttons": False,
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(site_dir)},
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
    }
    return DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
        data_docs_sites={_SITE: site},
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False),
    )


def _frame(table: pa.Table) -> Any:
    """``table`` as the pandas frame GX validates, with the values unchanged but typed for speed.

    A uint64 column whose values all fit int64 becomes int64: GX checks bounds on int64 and float64
    columns vectorized, and on other numeric columns value by value in Python. String columns are
    Python objects: pandas 3's Arrow-backed ``str`` finds duplicates ~15x slower (1 s per id
    column of 400,000 calls at 10^8 tokens).
    """
    for index, field in enumerate(table.schema):
        column = table.column(index)
        if pa.types.is_uint64(field.type) and (pc.max(column).as_py() or 0) <= INT64_MAX:
            table = table.set_column(index, field.with_type(pa.int64()), column.cast(pa.int64()))
    frame = table.to_pandas()
    for field in table.schema:
        if pa.types.is_string(field.type) or pa.types.is_large_string(field.type):
            frame[field.name] = frame[field.name].astype(object)
    return frame


def _arguments(spec: ExpectationSpec) -> dict[str, Any]:
    """The GX expectation's arguments: the spec's, its severity (ours in ``meta``, GX's own too) and its rule.

    The rule is the expectation's ``description``, which Data Docs show in place of GX's own
    wording (a string template: rules never contain ``$``).
    """
    return {
        **spec.kwargs,
        "meta": {"name": spec.name, "severity": spec.severity, "threshold_field": spec.threshold_field},
        "severity": GX_SEVERITY[spec.severity],
        "description": f"{spec.name} [{spec.severity}]: {spec.rule}",
        "catch_exceptions": True,
    }


def _result(found: Any, index_column: str, *, values: bool = False) -> ExpectationResult:
    """An :class:`ExpectationResult` from a GX ``ExpectationValidationResult``; its examples are the offending rows'
    ids, or with ``values`` their distinct offending values, the most frequent first (among those GX kept)."""
    error = _error_of(found.exception_info or {})
    result = found.result or {}
    checked = int(result.get("element_count", 0)) - int(result.get("missing_count", 0) or 0)
    unexpected = int(result.get("unexpected_count", 0) or 0)
    if values:
        rows = [c.get("value") for c in result.get("partial_unexpected_counts") or () if isinstance(c, dict)]
    else:
        rows = [
            row.get(index_column) if isinstance(row, dict) else row
            for row in result.get("partial_unexpected_index_list") or ()
        ]
    examples: dict[str, None] = {}
    for value in rows:
        if len(examples) == MAX_EXAMPLES:
            break
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            examples[str(value)] = None
    return ExpectationResult(
        success=bool(found.success) and error is None,
        checked=max(checked, 0),
        unexpected_count=unexpected,
        examples=tuple(examples),
        error=error,
    )


def _error_of(info: dict[str, Any]) -> str | None:
    """The message of an exception GX caught: ``exception_info`` is flat, or keyed by the metric that raised."""
    if "raised_exception" in info:
        return info["exception_message"] if info["raised_exception"] else None
    messages = [v.get("exception_message") for v in info.values() if isinstance(v, dict)]
    return "; ".join(dict.fromkeys(m for m in messages if m)) or None
