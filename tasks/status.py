"""`rollout-ledger status`: what a batch holds, read from its storage alone.

The first thing a user runs when a batch looks wrong. It only reads: nothing is written,
renamed or deleted, so it is safe against a batch whose shards are being generated. It reports
the plan, each shard's state, totals over the committed ledger, the dataset's state with its
review decision (``reports/review.json``), the reports, and names the next step.

A shard is ``committed`` when its marker validates and every file the marker names checks
out; ``unreadable`` when its marker, a committed file or an attempt claim cannot be trusted
(the error is reported, never raised); otherwise ``not_started`` (no attempt left an object),
``in_progress`` (an attempt was claimed or wrote an object within ``active_within_s``) or
``abandoned``. In progress versus abandoned is inferred from storage times: a live writer that
writes nothing for longer than ``active_within_s`` looks abandoned.

A failover (engine ``vllm_server`` lost one of its replicas, and the shard went on in a new
attempt on the others: docs/servers.md) is read from the claims: an attempt whose next attempt
the same process (host and pid) claimed failed over, since a generate process claims a shard
again only then.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shlex
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tasks import layout
from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.errors import MalformedClaimError, MalformedReviewError, StorageIntegrityError, UncommittedShardError
from tasks.publish import PUBLISHABLE
from tasks.records.ledger import FAILED_OVER_NOTE, SERVED_BY_NOTE
from tasks.records.review import ReviewDecision
from tasks.records.suite_summary import SUITES
from tasks.storage.claims import AttemptClaim, read_claims
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.marker import SHARD_FILE_KINDS, ShardCounts, parse_shard_object
from tasks.storage.objects import ObjectStore

ACTIVE_WITHIN_S = 600.0  # an attempt that wrote nothing for this long is taken as abandoned
SHARD_STATES = ("committed", "in_progress", "abandoned", "not_started", "unreadable")
DATASET_STATES = (
    "none",
    "staged",
    "validation_failed",
    "awaiting_review",
    "validated",
    "rejected",
    "published",
    "unreadable",
)


@dataclass(frozen=True)
class PlanStatus:
    """What ``plan/batch.json`` fixed: environment, model and its provenance, sizes, versions."""

    environment: str
    model_reference: str
    weights_sha256: str
    tokenizer_sha256: str
    chat_template_sha256: str
    num_tasks: int
    group_size: int
    shards: int
    rollouts: int
    weight_version: int
    code_version: str

    @classmethod
    def of(cls, config: BatchConfig) -> PlanStatus:
        return cls(
            environment=config.environment,
            model_reference=config.model.reference,
            **config.model.provenance,
            num_tasks=config.num_tasks,
            group_size=config.group_size,
            shards=config.shards,
            rollouts=config.num_rollouts,
            weight_version=config.weight_version,
            code_version=config.code_version,
        )


@dataclass(frozen=True)
class AttemptStatus:
    """An uncommitted attempt: its claim (None when it left objects without one) and what it left.

    ``objects`` counts the attempt's objects by kind (staging, calls, failures, receipts);
    ``last_activity`` is the newest of the claim's start and those objects' modification times;
    ``failed_over``: its process went on in the next attempt (see the module docstring).
    """

    attempt: int
    claim: AttemptClaim | None
    objects: dict[str, int]
    last_activity: float | None
    failed_over: bool = False


@dataclass(frozen=True)
class CommittedShard:
    """A committed shard: the marker's attempt and counts, and facts read from its named ledger files.

    ``failures_by_reason`` counts every named failure row; ``poisoned_by_reason`` the poisoned
    receipts; the weight versions range over every named call record (None without calls);
    ``failovers`` are the earlier attempts that failed over (see the module docstring);
    ``calls_by_server`` and ``rollouts_failed_over`` sum what the receipts say of where their calls
    ran (an engine of several servers: :func:`tasks.generate.receipts.capture_notes`).
    """

    attempt: int
    committed_at: float
    counts: ShardCounts
    failures_by_reason: dict[str, int]
    poisoned_by_reason: dict[str, int]
    weight_version_min: int | None
    weight_version_max: int | None
    failovers: tuple[int, ...] = ()
    calls_by_server: dict[str, int] = dataclasses.field(default_factory=dict)
    rollouts_failed_over: int = 0


@dataclass(frozen=True)
class ShardStatus:
    """One planned shard; ``committed`` is set exactly when ``state`` is committed, ``error`` when unreadable."""

    shard: int
    state: str
    committed: CommittedShard | None = None
    attempts: tuple[AttemptStatus, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class Totals:
    """Sums over the committed shards' markers and named ledger files."""

    committed_shards: int
    rollouts: int
    ok: int
    poisoned: int
    failed: int
    calls: int
    failure_rows: int
    failures_by_reason: dict[str, int]
    poisoned_by_reason: dict[str, int]
    weight_version_min: int | None
    weight_version_max: int | None


@dataclass(frozen=True)
class DatasetStatus:
    """The dataset's state; counts and partiality from the committed manifest, else the staged one.

    ``suites`` maps each validation suite that has run to its current run's status (``passed``,
    ``warned``, ``failed``) or ``unreadable``. ``review`` is the decision recorded on the batch;
    ``awaiting_review``: both suites ran, one warned, nobody has decided; ``rejected``: a decision
    rejected it (never published).
    """

    state: str
    partial: bool | None = None
    missing_shards: tuple[int, ...] = ()
    rows: int | None = None
    trainable_rows: int | None = None
    groups: int | None = None
    suites: dict[str, str] = dataclasses.field(default_factory=dict)
    review: ReviewDecision | None = None
    error: str | None = None


@dataclass(frozen=True)
class ReportsStatus:
    """Every object under ``reports/`` (batch-relative paths) and the overview page, if written."""

    objects: tuple[str, ...]
    index: str | None


@dataclass(frozen=True)
class BatchStatus:
    """Everything ``rollout-ledger status`` reports about one batch; ``url`` is the batch directory."""

    batch_id: str
    root_url: str
    url: str
    observed_at: float
    plan: PlanStatus
    shards: tuple[ShardStatus, ...]
    totals: Totals
    dataset: DatasetStatus
    reports: ReportsStatus
    next_step: str

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (dicts, lists, str, numbers, bools, None)."""
        return _plain(dataclasses.asdict(self))


def batch_status(batch: Batch, *, now: float | None = None, active_within_s: float = ACTIVE_WITHIN_S) -> BatchStatus:
    """The status of ``batch``, read without writing anything.

    Raises :class:`~tasks.errors.ConfigError` naming the URL when the batch was never planned;
    any later problem (a corrupt marker, claim or ledger file) is reported in the status instead.
    """
    config = batch.config
    now = time.time() if now is None else now
    shards = tuple(_shard_status(batch, shard, now - active_within_s) for shard in range(config.shards))
    reports = _reports_status(batch)
    dataset = _dataset_status(batch)
    root_url, batch_id = batch.root_url, batch.batch_id
    return BatchStatus(
        batch_id=batch_id,
        root_url=root_url,
        url=batch.url,
        observed_at=now,
        plan=PlanStatus.of(config),
        shards=shards,
        totals=_totals(s.committed for s in shards if s.committed is not None),
        dataset=dataset,
        reports=reports,
        next_step=_next_step(root_url, batch_id, shards, dataset, reports),
    )


# --- shards ---------------------------------------------------------------------------------


def _shard_status(batch: Batch, shard: int, active_since: float) -> ShardStatus:
    store = batch.store
    try:
        ledger = batch.ledger(shard)
    except UncommittedShardError:
        try:
            return _uncommitted_status(store, shard, active_since)
        except MalformedClaimError as exc:
            return ShardStatus(shard=shard, state="unreadable", error=f"{type(exc).__name__}: {exc}")
    except (StorageIntegrityError, ValueError, OSError) as exc:
        return ShardStatus(shard=shard, state="unreadable", error=f"{type(exc).__name__}: {exc}")
    try:
        failovers = failed_over(read_claims(store, shard))
    except MalformedClaimError as exc:
        return ShardStatus(shard=shard, state="unreadable", error=f"{type(exc).__name__}: {exc}")
    return ShardStatus(shard=shard, state="committed", committed=_committed_shard(ledger, failovers))


def failed_over(claims: Iterable[AttemptClaim]) -> tuple[int, ...]:
    """The attempts whose next attempt the same process (host, pid) claimed: each failed over."""
    ordered = sorted(claims, key=lambda claim: claim.attempt)
    return tuple(a.attempt for a, b in itertools.pairwise(ordered) if (a.host, a.pid) == (b.host, b.pid))


def _committed_shard(ledger: LedgerReader, failovers: tuple[int, ...]) -> CommittedShard:
    tables = ledger.tables
    receipts = tables.receipts
    poisoned = receipts.filter(pc.equal(receipts.column("status"), "poisoned"))
    versions = pc.min_max(tables.calls.column("weight_version")).as_py()
    calls_by_server, failed_over = _where_calls_ran(receipts.column("reward_info").to_pylist())
    return CommittedShard(
        attempt=ledger.marker.attempt,
        committed_at=ledger.marker.committed_at,
        counts=ledger.marker.counts,
        failures_by_reason=_value_counts(tables.failures.column("reason")),
        poisoned_by_reason=_value_counts(poisoned.column("failure_reason")),
        weight_version_min=versions["min"],
        weight_version_max=versions["max"],
        failovers=failovers,
        calls_by_server=calls_by_server,
        rollouts_failed_over=failed_over,
    )


def _where_calls_ran(reward_infos: Iterable[str]) -> tuple[dict[str, int], int]:
    """Calls per server summed over the receipts' ``served_by`` notes, and the receipts with ``failed_over``.

    The reward info is storage content: a receipt whose notes are not of that shape counts nothing.
    """
    calls: Counter[str] = Counter()
    failed_over = 0
    for text in reward_infos:
        try:
            info = json.loads(text)
        except (TypeError, ValueError):
            continue
        if not isinstance(info, dict):
            continue
        served = info.get(SERVED_BY_NOTE)
        if isinstance(served, dict) and all(isinstance(n, int) and n >= 0 for n in served.values()):
            calls.update({str(url): n for url, n in served.items()})
        failed_over += bool(info.get(FAILED_OVER_NOTE))
    return dict(sorted(calls.items())), failed_over


def _value_counts(column: pa.ChunkedArray) -> dict[str, int]:
    """Occurrences of each value, by value (nulls left out)."""
    counted = pc.value_counts(column.drop_null()).to_pylist()
    return {entry["values"]: entry["counts"] for entry in sorted(counted, key=lambda e: e["values"])}


def _uncommitted_status(store: ObjectStore, shard: int, active_since: float) -> ShardStatus:
    """An uncommitted shard's attempts (a claim that does not parse raises: the shard is then unreadable)."""
    objects = _attempt_objects(store, shard)
    if not objects:
        return ShardStatus(shard=shard, state="not_started")
    claims = {claim.attempt: claim for claim in read_claims(store, shard)}
    failovers = failed_over(claims.values())
    attempts = tuple(
        AttemptStatus(
            attempt=attempt,
            claim=claims.get(attempt),
            objects={kind: sum(kind == k for k, _ in found) for kind in SHARD_FILE_KINDS},
            last_activity=_last_activity(store, claims.get(attempt), found),
            failed_over=attempt in failovers,
        )
        for attempt, found in sorted(objects.items())
    )
    active = any(a.last_activity is not None and a.last_activity >= active_since for a in attempts)
    return ShardStatus(shard=shard, state="in_progress" if active else "abandoned", attempts=attempts)


def _attempt_objects(store: ObjectStore, shard: int) -> dict[int, list[tuple[str, str]]]:
    """attempt -> (kind, path) of each object it left under the shard's staging and ledger directories.

    Kinds are the marker's file kinds and the claim's name; other names (temp files of a crashed
    local write) count as ``other``. Objects outside attempt directories (the marker) are skipped.
    """
    found: dict[int, list[tuple[str, str]]] = {}
    for directory in (layout.staging_shard_dir(shard), layout.ledger_shard_dir(shard)):
        for path in store.list_files(directory):
            try:
                attempt = layout.attempt_of(path)
            except ValueError:
                continue
            found.setdefault(attempt, []).append((_object_kind(path, shard), path))
    return found


def _object_kind(path: str, shard: int) -> str:
    if path.endswith("/" + layout.CLAIM_NAME):
        return layout.CLAIM_NAME
    try:
        return parse_shard_object(path, shard).kind
    except ValueError:
        return "other"


def _last_activity(store: ObjectStore, claim: AttemptClaim | None, found: list[tuple[str, str]]) -> float | None:
    """Newest of the claim's start and the modification times of the attempt's newest object of each kind.

    Objects of one kind are written in index order, so the highest-named is the newest.
    """
    newest = {kind: path for kind, path in sorted(found) if kind in SHARD_FILE_KINDS}
    times = [claim.started_at] if claim is not None else []
    for path in newest.values():
        try:
            times.append(store.modified_at(path))
        except (FileNotFoundError, NotImplementedError):  # swept meanwhile, or a filesystem without times
            continue
    return max(times, default=None)


def _totals(committed: Iterable[CommittedShard]) -> Totals:
    shards = list(committed)
    failures: Counter[str] = Counter()
    poisoned: Counter[str] = Counter()
    for shard in shards:
        failures.update(shard.failures_by_reason)
        poisoned.update(shard.poisoned_by_reason)
    minima = [s.weight_version_min for s in shards if s.weight_version_min is not None]
    maxima = [s.weight_version_max for s in shards if s.weight_version_max is not None]
    return Totals(
        committed_shards=len(shards),
        rollouts=sum(s.counts.rollouts for s in shards),
        ok=sum(s.counts.ok for s in shards),
        poisoned=sum(s.counts.poisoned for s in shards),
        failed=sum(s.counts.failed for s in shards),
        calls=sum(s.counts.calls for s in shards),
        failure_rows=sum(s.counts.failures for s in shards),
        failures_by_reason=dict(sorted(failures.items())),
        poisoned_by_reason=dict(sorted(poisoned.items())),
        weight_version_min=min(minima, default=None),
        weight_version_max=max(maxima, default=None),
    )


# --- dataset and reports --------------------------------------------------------------------


def _reports_status(batch: Batch) -> ReportsStatus:
    objects = batch.report_objects()
    return ReportsStatus(objects=objects, index=layout.REPORTS_INDEX if layout.REPORTS_INDEX in objects else None)


def _dataset_status(batch: Batch) -> DatasetStatus:
    """Published (a valid committed manifest) wins, then a rejection; a staged dataset is judged by its suites."""
    suites = _suite_outcomes(batch)
    try:
        review = batch.review()
        marker = batch.dataset()
    except (StorageIntegrityError, MalformedReviewError, ValueError, OSError) as exc:
        return DatasetStatus(state="unreadable", suites=suites, error=f"{type(exc).__name__}: {exc}")
    rejected = review is not None and not review.approved
    if marker is None:
        return DatasetStatus(state="rejected" if rejected else "none", suites=suites, review=review)
    if marker.validation is not None:
        state = "published"
    elif rejected:
        state = "rejected"
    elif any(suites.get(suite) in ("failed", "unreadable") for suite in SUITES):
        state = "validation_failed"
    elif all(suites.get(suite) in PUBLISHABLE for suite in SUITES):
        state = "awaiting_review" if review is None and "warned" in suites.values() else "validated"
    else:
        state = "staged"
    return DatasetStatus(
        state=state,
        partial=marker.partial,
        missing_shards=tuple(marker.missing_shards),
        rows=marker.rows,
        trainable_rows=marker.trainable_rows,
        groups=marker.groups,
        suites=suites,
        review=review,
    )


def _suite_outcomes(batch: Batch) -> dict[str, str]:
    """Each suite's status in its current run (``passed``/``warned``/``failed``/``unreadable``); unrun ones left out."""
    outcomes = {}
    for suite in SUITES:
        try:
            summary = batch.suite_summary(suite)
        except (ValueError, OSError):
            outcomes[suite] = "unreadable"
            continue
        if summary is not None:
            outcomes[suite] = summary.status
    return outcomes


# --- next step and text ---------------------------------------------------------------------


def _next_step(
    root_url: str, batch_id: str, shards: tuple[ShardStatus, ...], dataset: DatasetStatus, reports: ReportsStatus
) -> str:
    """One sentence: the command or check that moves the batch on."""
    target = f"--root {shlex.quote(root_url)} --batch-id {batch_id}"
    by_state = {state: [s.shard for s in shards if s.state == state] for state in SHARD_STATES}
    if dataset.state == "rejected" and dataset.review is not None:
        return f"nothing to run: the batch was rejected ({dataset.review.describe()}), so it is never published"
    if dataset.state == "published":
        if dataset.partial:
            return f"nothing to run: the dataset is published without shard(s) {list(dataset.missing_shards)}"
        return "nothing to run: the dataset is published"
    if by_state["unreadable"]:
        return (
            f"inspect shard(s) {by_state['unreadable']}: their data cannot be trusted (errors above); "
            "if it cannot be repaired, re-plan under a new batch id"
        )
    if dataset.state == "unreadable":
        return "inspect the dataset's records: they cannot be trusted (error above)"
    if dataset.state == "awaiting_review":
        where = reports.index or f"{layout.REPORTS_DIR}/"
        return (
            f"read the validation reports ({where}) and decide: `rollout-ledger publish {target} --approve --reason "
            "TEXT` or `--reject --reason TEXT` (or answer the run's Airflow review task)"
        )
    if dataset.state == "validation_failed":
        where = reports.index or f"{layout.REPORTS_DIR}/"
        return f"read the validation reports ({where}): validation failed, so nothing was published"
    if dataset.state in ("staged", "validated"):
        return f"run `rollout-ledger finalize {target}` to validate and publish the staged dataset"
    runnable = sorted(by_state["not_started"] + by_state["abandoned"])
    if runnable:
        flags = " ".join(f"--shard {s}" for s in runnable)
        return f"run `rollout-ledger generate {target} {flags}`"
    if by_state["in_progress"]:
        return f"wait for shard(s) {by_state['in_progress']} in progress, then run status again"
    return f"run `rollout-ledger finalize {target}`"


def render_status(status: BatchStatus) -> str:
    """A compact text: plan header, one line per shard, totals, dataset, reports, next step."""
    lines = [*_plan_lines(status), "shards:"]
    lines += [f"  {line}" for shard in status.shards for line in _shard_lines(shard)]
    lines += _totals_lines(status.totals, status.plan.rollouts)
    lines += _dataset_lines(status.dataset)
    lines += _reports_lines(status.url, status.reports)
    lines.append(f"next step: {status.next_step}")
    return "\n".join(lines) + "\n"


def _plan_lines(status: BatchStatus) -> list[str]:
    plan = status.plan
    hashes = ", ".join(
        f"{name} {_short(value)}"
        for name, value in (
            ("weights", plan.weights_sha256),
            ("tokenizer", plan.tokenizer_sha256),
            ("chat template", plan.chat_template_sha256),
        )
    )
    return [
        f"batch {status.batch_id} at {status.url}",
        f"  plan: {plan.environment}, {plan.num_tasks} tasks x {plan.group_size} = {plan.rollouts} rollouts "
        f"in {plan.shards} shard(s); weight version {plan.weight_version}; code {plan.code_version or 'unrecorded'}",
        f"  model: {plan.model_reference} ({hashes})",
    ]


def _shard_lines(shard: ShardStatus) -> list[str]:
    head = f"shard {shard.shard:<3} {shard.state:<11}"
    if shard.committed is not None:
        c, counts = shard.committed, shard.committed.counts
        return [
            f"{head} attempt {c.attempt}: {counts.rollouts} rollouts ({counts.ok} ok, {counts.poisoned} poisoned, "
            f"{counts.failed} failed, {counts.adopted_rollouts} adopted), {counts.calls} calls, "
            f"{counts.failures} failure rows, {counts.staged_rows} staged rows"
            + (f"; failed over from attempt(s) {list(c.failovers)}" if c.failovers else "")
            + (f"; {c.rollouts_failed_over} rollout(s) restarted on a live server" if c.rollouts_failed_over else "")
        ] + ([f"  calls per server: {_per_server(c.calls_by_server)}"] if c.calls_by_server else [])
    lines = [head.rstrip() + (f" {shard.error}" if shard.error else "")]
    lines += [f"  {_attempt_line(attempt)}" for attempt in shard.attempts]
    return lines


def _per_server(calls: Mapping[str, int]) -> str:
    return ", ".join(f"{url} {n}" for url, n in calls.items())


def _attempt_line(attempt: AttemptStatus) -> str:
    left = ", ".join(f"{n} {kind}" for kind, n in attempt.objects.items())
    return (
        f"attempt {attempt.attempt}: {_claimant(attempt.claim)}; left {left} object(s); "
        f"last activity {_time(attempt.last_activity)}"
        + ("; failed over to the next attempt" if attempt.failed_over else "")
    )


def _claimant(claim: AttemptClaim | None) -> str:
    if claim is None:
        return "no readable claim"
    try_number = f" (try {claim.try_number})" if claim.try_number is not None else ""
    return f"claimed by {claim.host} pid {claim.pid} at {_time(claim.started_at)}{try_number}"


def _totals_lines(totals: Totals, planned: int) -> list[str]:
    versions = (
        "none" if totals.weight_version_min is None else f"{totals.weight_version_min}..{totals.weight_version_max}"
    )
    return [
        f"totals ({totals.committed_shards} committed shard(s)): {totals.rollouts}/{planned} rollouts receipted "
        f"({totals.ok} ok, {totals.poisoned} poisoned, {totals.failed} failed), {totals.calls} calls, "
        f"{totals.failure_rows} failure rows; weight versions {versions}",
        f"  failures by reason: {_counts(totals.failures_by_reason)}",
        f"  poisoned by reason: {_counts(totals.poisoned_by_reason)}",
    ]


def _dataset_lines(dataset: DatasetStatus) -> list[str]:
    parts = [dataset.state]
    if dataset.rows is not None:
        parts.append(f"{dataset.rows} rows ({dataset.trainable_rows} trainable) in {dataset.groups} groups")
    if dataset.partial:
        parts.append(f"PARTIAL: missing shard(s) {list(dataset.missing_shards)}")
    if dataset.suites:
        parts.append("validation " + _counts(dataset.suites))
    if dataset.error:
        parts.append(dataset.error)
    lines = ["dataset: " + "; ".join(parts)]
    if dataset.review is not None:
        lines.append(f"  review: {dataset.review.describe()}")
    return lines


def _reports_lines(url: str, reports: ReportsStatus) -> list[str]:
    if not reports.objects:
        return ["reports: none"]
    head = f"reports: {len(reports.objects)} object(s) under {url}/{layout.REPORTS_DIR}/"
    key = [p for p in reports.objects if p == reports.index or p.endswith("/summary.json")]
    return [head, *(f"  {url}/{path}" for path in key)]


def _counts(counts: Mapping[str, object]) -> str:
    return ", ".join(f"{key} {value}" for key, value in counts.items()) or "none"


def _short(sha256: str) -> str:
    return sha256[:12] if sha256 else "unrecorded"


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists, recursively, so it equals its own JSON round trip."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
