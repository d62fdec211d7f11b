"""What a generate run returns per shard: :class:`ShardSummary`, and :class:`RolloutsFailedError` for a shard
whose every rollout failed.

The counts of a committed shard come from its marker, whichever attempt wrote it: ``calls`` the
calls its receipted rollouts use (the marker's ``calls_used``; None, unknown, from a version-1 marker,
which did not record it), ``calls_recorded`` every call record it names, those no rollout uses included
(an earlier attempt's, diverged from, not replayed, or in flight when it ended). Only what
this run measured itself (tokens generated, seconds, orphans swept, the training signal of the
rollouts it saw, the requests its capture gateway refused for want of a valid key, the calls each
server replica answered, the failovers, and what resuming rollouts replayed) is added to them.
A shard with failed rollouts also says why, as their receipts recorded it (:func:`with_failed_rollouts`):
the failed receipts by reason, and the error each leading reason recorded (an agent's stderr, redacted as
the receipt holds it).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tasks.errors import UsageError
from tasks.records.ledger import Receipt
from tasks.storage.marker import ShardMarker
from tasks.training_signal import FAILED, TrainingSignal

FAILED_REASONS_KEPT = 3  # the leading failure reasons whose recorded error a summary keeps


class RolloutsFailedError(UsageError):
    """Every rollout of a shard failed (receipt status ``failed``: its agent exited non-zero, timed out, gave no
    reward...). The shard is committed and nothing is lost, but it holds nothing to train on and generating it again
    changes nothing: what the failures name (an agent command, a scorer, ``timeout_s``) is the batch's input, to fix
    in a new batch. Exit 2, so that an Airflow generate task fails at once, without retries."""

    reason = "rollouts_failed"


@dataclass(frozen=True)
class ShardSummary:
    """What a generate run committed (or found committed), and the training signal of what it ran."""

    batch_id: str
    shard: int
    attempt: int
    rollouts: int
    ok: int
    poisoned: int
    failed: int
    adopted: int
    calls: int | None  # used by the receipted rollouts; None: unknown (a version-1 marker)
    failures: int
    generated_tokens: int
    seconds: float
    already_committed: bool
    swept: int
    signal: TrainingSignal | None = None
    # Every call record the marker names, those no rollout uses included; None when nothing was recorded
    # (a run without capture).
    calls_recorded: int | None = None
    # Requests to this attempt's capture gateway without their route's key (or for an unknown
    # rollout id): counted here, never on a rollout, since their sender may not be its agent.
    gateway_auth_failures: int = 0
    # An engine of replicas (vllm_server): the calls each answered for this shard in this run (lost
    # attempts' included), by URL, and one line per failover ("attempt N: why the replica was lost").
    calls_by_replica: dict[str, int] = field(default_factory=dict)
    failovers: tuple[str, ...] = ()
    # Rollouts this run resumed (earlier calls replayed, or a replay refused), the calls answered from
    # their books, the calls sampled live after a replay began, and the replays a call diverged from.
    resumed: int = 0
    replayed_calls: int = 0
    live_calls: int = 0
    divergences: int = 0
    # The shard's failed receipts (every attempt's) by failure reason, most first, and for the leading
    # reasons (FAILED_REASONS_KEPT) the error most of their receipts recorded (``reward_info.error``,
    # the reason's prefix left out: an agent's stderr, redacted as recorded). Empty when none failed.
    failed_reasons: dict[str, int] = field(default_factory=dict)
    failed_errors: dict[str, str] = field(default_factory=dict)

    @property
    def all_failed(self) -> bool:
        """Every rollout of the shard failed (none ok, none poisoned)."""
        return self.rollouts > 0 and self.failed == self.rollouts

    @classmethod
    def of_marker(cls, marker: ShardMarker, **extra: Any) -> ShardSummary:
        counts = marker.counts
        return cls(
            batch_id=marker.batch_id,
            shard=marker.shard,
            attempt=marker.attempt,
            rollouts=counts.rollouts,
            ok=counts.ok,
            poisoned=counts.poisoned,
            failed=counts.failed,
            adopted=counts.adopted_rollouts,
            calls=counts.calls_used,
            calls_recorded=counts.calls_recorded,
            failures=counts.failures,
            **({"generated_tokens": 0, "seconds": 0.0, "already_committed": True, "swept": 0} | extra),
        )


def with_failed_rollouts(summary: ShardSummary, receipts: Iterable[Receipt]) -> ShardSummary:
    """``summary`` with its shard's failed receipts by reason and the error each leading reason recorded."""
    failed = [r for r in receipts if r.status == FAILED]
    by_reason = Counter(r.failure_reason or FAILED for r in failed)
    errors: dict[str, Counter[str]] = {}
    for receipt in failed:
        reason = receipt.failure_reason or FAILED
        errors.setdefault(reason, Counter())[_recorded_error(receipt, reason)] += 1
    leading = [reason for reason, _ in by_reason.most_common()]
    return dataclasses.replace(
        summary,
        failed_reasons=dict(by_reason.most_common()),
        failed_errors={reason: errors[reason].most_common(1)[0][0] for reason in leading[:FAILED_REASONS_KEPT]},
    )


def _recorded_error(receipt: Receipt, reason: str) -> str:
    """The error a failed receipt recorded (its reward info's ``error``), without its ``reason: `` prefix."""
    try:
        error = json.loads(receipt.reward_info).get("error")
    except (ValueError, AttributeError):
        error = None
    if not isinstance(error, str):
        return "(no error recorded)"
    return error.removeprefix(f"{reason}: ")
