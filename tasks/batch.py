"""One batch on storage, opened once: its store, config, plans, manifests, suite outcomes and review.

Every stage, ``status``, the report, the report viewer, the review form and the CLI take a
:class:`Batch` rather than a root URL, a batch id and storage options. The handle reads; each stage
writes its own objects (plan the config and shard plans, generate the shards, finalize the staged
dataset, validate the suite runs, publish the review and the committed manifest).

What a reader returns is what storage holds at that moment, parsed strictly (a malformed object
raises the error of :mod:`tasks.errors` that names it). Only the config is cached: it is written
once, at plan time, and never changes.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pyarrow as pa

from tasks import layout
from tasks.config import BatchConfig
from tasks.errors import ConfigError, MalformedReviewError, MalformedSummaryError
from tasks.records.planned import PlannedRollout
from tasks.records.profile_metrics import ProfileMetrics
from tasks.records.review import ReviewDecision
from tasks.records.suite_summary import SUITES, SuiteSummary
from tasks.schema import read_parquet_bytes
from tasks.storage.dataset_manifest import (
    DatasetMarker,
    read_dataset_marker,
    read_dataset_part,
    read_staged_marker,
)
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.marker import MarkedFile, ShardMarker, read_marked_bytes, read_marker
from tasks.storage.objects import ObjectStore
from tasks.storage.options import StorageOptions


class Batch:
    """The batch ``batch_id`` under ``root_url``: ``store`` is rooted at its directory, ``url`` names it;
    ``root_store`` is the storage root's (where :mod:`tasks.storage.roots` looks for the root and its batches).

    A root URL fsspec would read as a local path though it looks like a URL (``s3:/bucket``,
    ``file://host/path``) is refused here, before anything is read or written
    (:func:`tasks.storage.root_urls.check_url_form`); which schemes a person may give is checked where they give
    it (the CLI, Airflow's storage URL: :func:`tasks.storage.root_urls.check_root_url`).
    """

    def __init__(self, root_url: str, batch_id: str, storage_options: StorageOptions | None = None) -> None:
        self.root_url = root_url
        self.batch_id = batch_id
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        self.root_store = ObjectStore(root_url, **self.storage_options)
        self.store = self.root_store.child(layout.batch_dir(batch_id))

    @classmethod
    def open(cls, root_url: str, batch_id: str, storage_options: StorageOptions | None = None) -> Batch:
        """The handle of ``batch_id`` (a bad id raises ValueError); nothing is read until asked."""
        return cls(root_url, batch_id, storage_options)

    def __repr__(self) -> str:
        return f"Batch({self.url!r})"

    @property
    def url(self) -> str:
        """The batch directory's URL (no credentials)."""
        return self.store.url

    def url_of(self, relative: str) -> str:
        """The full URL of a batch-relative object name."""
        return f"{self.url}/{relative}"

    # --- plan ---------------------------------------------------------------------------------

    @functools.cached_property
    def config(self) -> BatchConfig:
        """``plan/batch.json``; :class:`~tasks.errors.ConfigError` naming the URL when the batch was never planned."""
        path = layout.plan_config()
        try:
            data = self.store.read_bytes(path)
        except FileNotFoundError:
            raise ConfigError(
                f"{self.url_of(path)} does not exist: run `rollout-ledger plan` for this batch first"
            ) from None
        return BatchConfig.from_json(data, source=self.url_of(path))

    def is_planned(self) -> bool:
        return self.store.exists(layout.plan_config())

    def shard_plan(self, shard: int) -> list[PlannedRollout]:
        """The planned rollouts of ``shard``, validated against the record schema."""
        if not 0 <= shard < self.config.shards:
            raise ConfigError(f"shard {shard} is out of range: the batch has {self.config.shards} shards")
        path = layout.plan_shard(shard)
        try:
            data = self.store.read_bytes(path)
        except FileNotFoundError:
            raise ConfigError(
                f"{self.url_of(path)} does not exist: the plan of shard {shard} is missing; re-plan the batch"
            ) from None
        return PlannedRollout.from_table(read_parquet_bytes(data), source=self.url_of(path))

    # --- shards -------------------------------------------------------------------------------

    def shard_marker(self, shard: int) -> ShardMarker | None:
        """The shard's commit marker, or None while it is uncommitted."""
        return read_marker(self.store, shard)

    def ledger(self, shard: int) -> LedgerReader:
        """The committed ledger of ``shard`` (:class:`~tasks.errors.UncommittedShardError` without a marker)."""
        return LedgerReader(self.store, shard)

    # --- dataset ------------------------------------------------------------------------------

    def staged_dataset(self) -> DatasetMarker | None:
        """The dataset as finalize built it (``dataset/_STAGED.json``), or None."""
        return read_staged_marker(self.store)

    def published_dataset(self) -> DatasetMarker | None:
        """The published dataset (``dataset/_COMMITTED.json``), or None."""
        return read_dataset_marker(self.store)

    def dataset(self) -> DatasetMarker | None:
        """The published manifest once there is one, else the staged one, else None."""
        return self.published_dataset() or self.staged_dataset()

    def dataset_metrics(self, manifest: DatasetMarker) -> dict[str, Any]:
        """``dataset/metrics.json`` as ``manifest`` names it (size and sha256 checked)."""
        return json.loads(read_marked_bytes(self.store, manifest.metrics, marker="the dataset manifest"))

    def dataset_part(self, part: MarkedFile) -> pa.Table:
        """A part a manifest names, after checking its size, sha256 and schema."""
        return read_dataset_part(self.store, part)

    # --- validation and review ----------------------------------------------------------------

    def suite_summary(self, suite: str) -> SuiteSummary | None:
        """The summary of ``suite``'s current run: the highest-numbered run with a summary (None: no run completed).

        Raises :class:`~tasks.errors.MalformedSummaryError` for a summary that does not parse
        strictly, or that names another suite or run than its path.
        """
        if suite not in SUITES:
            raise ValueError(f"suite must be one of {list(SUITES)}, got {suite!r}")
        for number in sorted(self.suite_runs(suite), reverse=True):
            run = layout.suite_run_name(number)
            path = layout.suite_summary(suite, run)
            try:
                data = self.store.read_bytes(path)
            except FileNotFoundError:
                continue  # a run that never completed
            summary = SuiteSummary.from_json(data, source=self.url_of(path))
            if (summary.suite, summary.run) != (suite, run):
                raise MalformedSummaryError(
                    f"{self.url_of(path)} is the summary of {summary.suite} {summary.run}, not of its own path"
                )
            return summary
        return None

    def suite_profile(self, summary: SuiteSummary) -> ProfileMetrics | None:
        """The profile numbers of the run ``summary`` completed (None: a run from before they were written)."""
        path = layout.suite_profile(summary.suite, summary.run)
        try:
            data = self.store.read_bytes(path)
        except FileNotFoundError:
            return None
        return ProfileMetrics.from_json(data, source=self.url_of(path))

    def suite_summaries(self) -> dict[str, SuiteSummary]:
        """Each suite's current summary, for the suites that have completed a run."""
        summaries = {suite: self.suite_summary(suite) for suite in SUITES}
        return {suite: summary for suite, summary in summaries.items() if summary is not None}

    def suite_runs(self, suite: str) -> set[int]:
        """Numbers of every run directory of ``suite`` that holds an object (claimed, complete or not)."""
        numbers = (layout.suite_run_number(path, suite) for path in self.store.list_files(layout.suite_dir(suite)))
        return {number for number in numbers if number is not None}

    def review(self) -> ReviewDecision | None:
        """The review decision (``reports/review.json``), or None; :class:`~tasks.errors.MalformedReviewError`."""
        try:
            data = self.store.read_bytes(layout.REVIEW_RECORD)
        except FileNotFoundError:
            return None
        source = self.url_of(layout.REVIEW_RECORD)
        decision = ReviewDecision.from_json(data, source=source)
        if decision.batch_id != self.batch_id:
            raise MalformedReviewError(
                f"{source}: the decision is on batch {decision.batch_id!r}, not {self.batch_id!r}"
            )
        return decision

    def report_objects(self) -> tuple[str, ...]:
        """Every object under ``reports/`` (batch-relative paths)."""
        return tuple(self.store.list_files(layout.REPORTS_DIR))
