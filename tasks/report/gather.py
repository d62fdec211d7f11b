"""What the overview page shows, read from a batch: plain typed figures, no HTML.

:func:`gather_report` is the only place the report reads storage. It reads the batch config, the
dataset manifest (``dataset/_COMMITTED.json`` once published, else finalize's
``dataset/_STAGED.json``), ``dataset/metrics.json`` (size and sha256 checked against the manifest),
a per-row profile of the parts (scalar columns and list lengths from Arrow; token lists never
become Python objects; one part in memory at a time), each suite's current summary
(``reports/{suite}/run-NNN/summary.json``) with the validation result pages beside it, and the
review decision (``reports/review.json``). Whatever is absent is None (the page says "not run");
a summary or review record that cannot be read is kept as its error message, never raised.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks import layout
from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.errors import MalformedReviewError
from tasks.layout import REVIEW_RECORD
from tasks.records.review import ReviewDecision
from tasks.records.suite_summary import LINEAGE, SUITES, ExpectationOutcome, SuiteSummary
from tasks.report.off_policy import OffPolicyFigures
from tasks.storage.dataset_manifest import DatasetMarker
from tasks.storage.objects import ObjectStore
from tasks.validate.suites import DATASET_TABLES, LINEAGE_TABLES

MAX_GROUPS_SHOWN = 48  # the reward plot shows an evenly spaced sample of groups beyond this
# Suite statuses from worst to best: the batch's verdict is the worst of its suites'.
STATUSES = ("failed", "unreadable", "not run", "warned", "passed")
DATASET_STATES = ("published", "rejected", "approved", "awaiting review", "staged", "not built")


@dataclass(frozen=True)
class GroupRewards:
    """The rewards of one group's rows: trainable ones, masked ones that have a reward, masked ones without."""

    group_id: str
    trainable: tuple[float, ...]
    masked: tuple[float, ...]
    unrewarded: int

    @classmethod
    def of(cls, group_id: str, rows: Sequence[tuple[float, bool]]) -> GroupRewards:
        """From ``(reward, trainable)`` per row; a missing reward is NaN."""
        masked = [reward for reward, trainable in rows if not trainable]
        return cls(
            group_id=group_id,
            trainable=tuple(reward for reward, trainable in rows if trainable),
            masked=tuple(reward for reward in masked if math.isfinite(reward)),
            unrewarded=sum(not math.isfinite(reward) for reward in masked),
        )


@dataclass(frozen=True)
class DatasetProfile:
    """Per-row scalars of the dataset's parts (no tokens), in row order, plus counts.

    ``group_rewards`` holds every ``stride``-th of the ``groups`` (every group when there are at
    most :data:`MAX_GROUPS_SHOWN`). ``version_min``/``version_max`` count rows per weight version
    (None: a masked row without linearized calls); ``spanning_rows`` have min != max.
    """

    rows: int
    groups: int
    trainable: np.ndarray  # bool
    num_turns: np.ndarray  # int
    lengths: np.ndarray  # int: len(input_ids)
    group_rewards: tuple[GroupRewards, ...]
    stride: int
    version_min: Mapping[int | None, int]
    version_max: Mapping[int | None, int]
    spanning_rows: int

    @property
    def versions(self) -> tuple[int | None, ...]:
        """Every weight version some row has as its min or its max (None: a row without one)."""
        return tuple({**self.version_min, **self.version_max})


@dataclass(frozen=True)
class Spread:
    """Count, mean, population std, min and max of a metric (``metrics.json``'s summaries); None when absent."""

    count: int | None = None
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, raw: object) -> Spread:
        return _fields_of(cls, raw)


@dataclass(frozen=True)
class AuditFigures:
    """The logprob audit's statistics in ``metrics.json`` (``finalize --audit``); a statistic is None when absent.

    ``off_policy`` is the off-policy gate's figures (:mod:`tasks.report.off_policy`), None when the
    audit recorded none (an older batch, or the gate off).
    """

    model_path: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    rows_eligible: int | None = None
    rows_audited: int | None = None
    tokens_audited: int | None = None
    filtered_out_tokens: int | None = None
    mean_abs_diff: float | None = None
    max_abs_diff: float | None = None
    p99_abs_diff: float | None = None
    raw_mean_abs_diff: float | None = None
    clip_low: float | None = None
    clip_high: float | None = None
    token_ratio_mean: float | None = None
    token_ratio_min: float | None = None
    token_ratio_max: float | None = None
    tokens_outside_clip: int | None = None
    token_outside_clip_fraction: float | None = None
    seq_ratio_mean: float | None = None
    seq_ratio_min: float | None = None
    seq_ratio_max: float | None = None
    sequences_outside_clip: int | None = None
    seq_outside_clip_fraction: float | None = None
    off_policy: OffPolicyFigures | None = None

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> AuditFigures:
        return _fields_of(cls, raw, off_policy=OffPolicyFigures.of(raw.get("off_policy")))


@dataclass(frozen=True)
class BatchMetrics:
    """The figures of ``dataset/metrics.json`` the page shows; a figure absent from the file is None.

    ``reward``, ``turns`` and ``row_length`` summarize trainable rows; the reasons count masked
    rollouts (finalize) and ledger failure rows (generate); ``group_weight_versions`` are the
    versions groups were generated at; ``audit`` is None when finalize ran without ``--audit``.
    """

    receipts: int | None = None
    missing_receipts: int | None = None
    rows: int | None = None
    trainable_rows: int | None = None
    masked_rows: int | None = None
    groups: int | None = None
    groups_zero_variance: int | None = None
    groups_single_valid: int | None = None
    groups_dropped: int | None = None
    tokens: int | None = None
    sampled_tokens: int | None = None
    ledger_calls: int | None = None
    calls_per_rollout: float | None = None
    token_in_rate: float | None = None
    truncated_rate: float | None = None
    epoch_span_count: int | None = None
    reward: Spread = Spread()
    turns: Spread = Spread()
    row_length: Spread = Spread()
    invalid_reasons: Mapping[str, int] = dataclasses.field(default_factory=dict)
    failure_reasons: Mapping[str, int] = dataclasses.field(default_factory=dict)
    group_weight_versions: tuple[int, ...] = ()
    audit: AuditFigures | None = None

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> BatchMetrics:
        """From the parsed ``metrics.json``."""
        audit = raw.get("audit")
        return _fields_of(
            cls,
            raw,
            reward=Spread.of(raw.get("reward")),
            turns=Spread.of(raw.get("turns")),
            row_length=Spread.of(raw.get("row_length")),
            invalid_reasons=_counts(raw.get("invalid_reasons")),
            failure_reasons=_counts(raw.get("failure_reasons")),
            group_weight_versions=tuple(int(v) for v in raw.get("group_weight_versions") or ()),
            audit=AuditFigures.of(audit) if isinstance(audit, Mapping) else None,
        )


@dataclass(frozen=True)
class SuiteView:
    """A suite's current summary (None: not run), why it could not be read, and whether its Data Docs exist.

    ``pages``: (table, batch-relative path) of the run's validation result pages, in the suite's
    table order. Linked from the card as well as from the Data Docs index, whose list of them is
    drawn by scripts from public CDNs and stays empty offline.
    """

    suite: str
    summary: SuiteSummary | None
    error: str | None = None
    docs: bool = False
    pages: tuple[tuple[str, str], ...] = ()

    @property
    def status(self) -> str:
        """``passed``, ``warned``, ``failed``, ``not run`` or ``unreadable``."""
        if self.error is not None:
            return "unreadable"
        return "not run" if self.summary is None else self.summary.status


@dataclass(frozen=True)
class ReportFigures:
    """Everything the page shows; ``dataset_state`` is one of :data:`DATASET_STATES`.

    ``manifest`` is the published marker when there is one, else the staged one, else None;
    ``metrics`` and ``profile`` come with it. ``review`` is the decision, or the error that makes
    its record unreadable, or None.
    """

    config: BatchConfig
    dataset_state: str
    manifest: DatasetMarker | None
    metrics: BatchMetrics | None
    profile: DatasetProfile | None
    suites: tuple[SuiteView, ...]
    review: ReviewDecision | str | None = None

    @property
    def verdict(self) -> str:
        """The batch's validation status: the worst of its suites' (:func:`overall_status`)."""
        return overall_status(self.suites)

    @property
    def problems(self) -> list[tuple[str, ExpectationOutcome]]:
        """(suite, expectation) of every expectation that failed or warned: failed first, then by suite and name."""
        found = [
            (view.suite, outcome)
            for view in self.suites
            if view.summary is not None
            for outcome in view.summary.expectations
            if not outcome.success
        ]
        return sorted(found, key=lambda p: (p[1].severity != "fail", p[0], p[1].name))

    @property
    def sources(self) -> list[str]:
        """The batch-relative paths the figures were read from."""
        read = [layout.plan_config()]
        if self.manifest is not None:
            published = self.dataset_state == "published"
            read += [layout.DATASET_MARKER if published else layout.DATASET_STAGED, layout.DATASET_METRICS]
        read += [REVIEW_RECORD] if self.review is not None else []
        read += [layout.suite_summary(s.suite, s.summary.run) for s in self.suites if s.summary is not None]
        return read


def gather_report(batch: Batch) -> ReportFigures:
    """The figures of ``batch``; absent inputs are None."""
    config = batch.config
    published = batch.published_dataset()
    manifest = published if published is not None else batch.staged_dataset()
    suites = tuple(read_suite_view(batch, suite) for suite in SUITES)
    review: ReviewDecision | str | None
    try:
        review = batch.review()
    except MalformedReviewError as exc:
        review = str(exc)
    return ReportFigures(
        config=config,
        dataset_state=dataset_state(published is not None, manifest is not None, review, suites),
        manifest=manifest,
        metrics=BatchMetrics.of(batch.dataset_metrics(manifest)) if manifest is not None else None,
        profile=read_dataset_profile(batch, manifest) if manifest is not None else None,
        suites=suites,
        review=review,
    )


def overall_status(suites: Sequence[SuiteView]) -> str:
    """The worst suite status, in the order of :data:`STATUSES`; ``passed`` when every suite passed."""
    statuses = {s.status for s in suites}
    return next(status for status in STATUSES if status in statuses or status == "passed")


def dataset_state(
    published: bool, staged: bool, review: ReviewDecision | str | None, suites: Sequence[SuiteView]
) -> str:
    """Published; else rejected or approved by the decision; else awaiting review (a suite warned, none failed)."""
    if published:
        return "published"
    if isinstance(review, ReviewDecision):
        return "approved" if review.approved else "rejected"
    if not staged:
        return "not built"
    statuses = {view.status for view in suites}
    return "awaiting review" if statuses <= {"passed", "warned"} and "warned" in statuses else "staged"


def read_dataset_profile(batch: Batch, manifest: DatasetMarker) -> DatasetProfile:
    """The per-row scalars of every part the manifest names, one part at a time."""
    stride = max(1, math.ceil(manifest.groups / MAX_GROUPS_SHOWN))
    trainable, turns, lengths = [], [], []
    rewards: dict[str, list[tuple[float, bool]]] = {}
    version_min: Counter[int | None] = Counter()
    version_max: Counter[int | None] = Counter()
    spanning, groups_seen, last_group = 0, 0, None
    for part in manifest.parts:
        table = batch.dataset_part(part)
        if not table.num_rows:
            continue
        group_ids = table.column("group_id").to_numpy(zero_copy_only=False)
        starts = np.ones(table.num_rows, bool)
        starts[1:] = group_ids[1:] != group_ids[:-1]
        starts[0] = group_ids[0] != last_group
        group_index = groups_seen - 1 + np.cumsum(starts)
        groups_seen, last_group = int(group_index[-1]) + 1, group_ids[-1]
        is_trainable = table.column("sample_mask").to_numpy() == 1
        reward = table.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)
        for row in np.flatnonzero(group_index % stride == 0).tolist():
            rewards.setdefault(str(group_ids[row]), []).append((float(reward[row]), bool(is_trainable[row])))
        trainable.append(is_trainable)
        turns.append(table.column("num_turns").to_numpy())
        lengths.append(pc.list_value_length(table.column("input_ids")).to_numpy())
        low, high = table.column("weight_version_min"), table.column("weight_version_max")
        version_min.update(_value_counts(low))
        version_max.update(_value_counts(high))
        spanning += pc.sum(pc.not_equal(low, high), min_count=0).as_py()
    return DatasetProfile(
        rows=manifest.rows,
        groups=manifest.groups,
        trainable=np.concatenate(trainable) if trainable else np.zeros(0, bool),
        num_turns=np.concatenate(turns) if turns else np.zeros(0, np.int64),
        lengths=np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
        group_rewards=tuple(GroupRewards.of(group_id, rows) for group_id, rows in rewards.items()),
        stride=stride,
        version_min=dict(version_min),
        version_max=dict(version_max),
        spanning_rows=spanning,
    )


def read_suite_view(batch: Batch, suite: str) -> SuiteView:
    """The summary of ``suite``'s current run (None when none completed), or why it cannot be read."""
    store = batch.store
    try:
        summary = batch.suite_summary(suite)
    except ValueError as exc:  # MalformedSummaryError, or JSON that does not parse
        return SuiteView(suite, None, error=str(exc))
    if summary is None:
        return SuiteView(suite, None)
    try:
        docs = store.exists(summary.report)
    except ValueError:  # not a batch-relative path
        return SuiteView(suite, summary)
    return SuiteView(suite, summary, docs=docs, pages=_validation_pages(store, suite, summary.report) if docs else ())


def _validation_pages(store: ObjectStore, suite: str, report: str) -> tuple[tuple[str, str], ...]:
    """The validation result pages beside the Data Docs index ``report``: ``validations/.../{suite}-{table}.html``."""
    found = {}
    for path in store.list_files(f"{report.rsplit('/', 1)[0]}/validations"):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(f"{suite}-") and name.endswith(".html"):
            found[name.removeprefix(f"{suite}-").removesuffix(".html")] = path
    tables = LINEAGE_TABLES if suite == LINEAGE else DATASET_TABLES
    return tuple((table.name, found[table.name]) for table in tables if table.name in found)


def _value_counts(column: pa.ChunkedArray) -> dict[int | None, int]:
    counts = pc.value_counts(column).to_pylist()
    return {c["values"]: c["counts"] for c in counts}


def _counts(raw: object) -> dict[str, int]:
    """A ``{reason: count}`` object of ``metrics.json`` (anything else: none)."""
    return {str(k): v for k, v in raw.items()} if isinstance(raw, Mapping) else {}


def _fields_of(cls: type, raw: object, **given: Any) -> Any:
    """``cls`` from the values ``raw`` holds under its field names (a field absent from ``raw`` keeps its default)."""
    values = {f.name: raw[f.name] for f in dataclasses.fields(cls) if isinstance(raw, Mapping) and f.name in raw}
    return cls(**(values | given))
