"""What ``rollout-ledger status`` reports about a batch: frozen records, no storage and no text.

A shard is ``committed`` when its marker validates and every file the marker names checks
out; ``unreadable`` when its marker, a committed file or an attempt claim cannot be trusted
(the error is kept, never raised); otherwise ``not_started`` (no attempt left an object),
``in_progress`` (an attempt was claimed or wrote an object within the activity window) or
``abandoned``. :meth:`BatchStatus.to_dict` equals its own JSON round trip.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tasks.config import BatchConfig
from tasks.records.review import ReviewDecision
from tasks.storage.claims import AttemptClaim
from tasks.storage.marker import ShardCounts

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
    ``failed_over``: its process went on in the next attempt (:func:`tasks.status.shards.failed_over`).
    """

    attempt: int
    claim: AttemptClaim | None
    objects: dict[str, int]
    last_activity: float | None
    failed_over: bool = False


@dataclass(frozen=True)
class ResumeCounts:
    """What resuming did, summed over receipts' ``resumed`` notes (:func:`tasks.generate.receipts.capture_notes`).

    ``rollouts``: receipts with a (well-formed) note, each a rollout that resumed; ``replayed_calls``:
    calls answered from a replay book; ``live_calls``: calls sampled live after a replay began;
    ``divergences``: replays a call diverged from; ``replays_refused``: episodes whose committed calls
    could not be replayed (``could_not_replay``), started afresh instead.
    """

    rollouts: int = 0
    replayed_calls: int = 0
    live_calls: int = 0
    divergences: int = 0
    replays_refused: int = 0

    def __add__(self, other: ResumeCounts) -> ResumeCounts:
        return ResumeCounts(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True))
        )


@dataclass(frozen=True)
class CommittedShard:
    """A committed shard: the marker's attempt and counts, and facts read from its named ledger files.

    ``calls``: the calls its receipted rollouts use (in their manifests, each once), counted from the
    named ledger files: the marker's ``counts.calls_used`` checked, or the figure a version-1 marker
    lacks (its ``counts.calls_used`` is None); ``counts.calls_recorded`` counts every named call record,
    those no rollout uses included. ``failures_by_reason`` counts every named failure row;
    ``poisoned_by_reason`` the poisoned receipts; the weight versions range over every named call
    record (None without calls);
    ``failovers`` are the earlier attempts that failed over (:func:`tasks.status.shards.failed_over`);
    ``calls_by_server`` and ``rollouts_failed_over`` sum what the receipts say of where their calls
    ran (an engine of several servers: :func:`tasks.generate.receipts.capture_notes`); ``resumed``
    what their ``resumed`` notes say (:class:`ResumeCounts`).
    """

    attempt: int
    committed_at: float
    counts: ShardCounts
    calls: int
    failures_by_reason: dict[str, int]
    poisoned_by_reason: dict[str, int]
    weight_version_min: int | None
    weight_version_max: int | None
    failovers: tuple[int, ...] = ()
    calls_by_server: dict[str, int] = dataclasses.field(default_factory=dict)
    rollouts_failed_over: int = 0
    resumed: ResumeCounts = ResumeCounts()


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
    """Sums over the committed shards' markers and named ledger files (``resumed``: their receipts' resume notes).

    ``calls``: the calls the receipted rollouts use (:attr:`CommittedShard.calls`); ``calls_recorded``:
    every named call record, those no rollout uses included (an earlier attempt's, diverged from, not
    replayed, or in flight when it ended).
    """

    committed_shards: int
    rollouts: int
    ok: int
    poisoned: int
    failed: int
    calls: int
    calls_recorded: int
    failure_rows: int
    failures_by_reason: dict[str, int]
    poisoned_by_reason: dict[str, int]
    weight_version_min: int | None
    weight_version_max: int | None
    resumed: ResumeCounts = ResumeCounts()


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


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists, recursively, so it equals its own JSON round trip."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
