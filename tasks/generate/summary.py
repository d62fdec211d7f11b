"""What a generate run returns per shard: :class:`ShardSummary`.

The counts of a committed shard come from its marker, whichever attempt wrote it; only what
this run measured itself (tokens generated, seconds, orphans swept, the training signal of the
rollouts it saw, the requests its capture gateway refused for want of a valid key, the calls each
server replica answered, the failovers, and what resuming rollouts replayed) is added to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tasks.storage.marker import ShardMarker
from tasks.training_signal import TrainingSignal


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
    calls: int
    failures: int
    generated_tokens: int
    seconds: float
    already_committed: bool
    swept: int
    signal: TrainingSignal | None = None
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
            calls=counts.calls,
            failures=counts.failures,
            **({"generated_tokens": 0, "seconds": 0.0, "already_committed": True, "swept": 0} | extra),
        )
