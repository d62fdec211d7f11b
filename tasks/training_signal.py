"""What a trainer cares about in a shard or a dataset: rewards, groups without signal, unusable rollouts, truncation.

Printed at the end of ``generate`` (from the shard's receipts and terminal calls) and of
``finalize`` (from the dataset's metrics), in the same words. A group carries no GRPO training
signal when fewer than two of its rollouts are usable or all of their rewards are equal: every
advantage of the group is then 0. The advice follows the cause: rollouts that failed (their agent
or environment gave no reward: :data:`FAILED_ADVICE`), rollouts that were poisoned (a captured call
failed, or the scored call could not be named: :data:`POISONED_ADVICE`), and usable rollouts whose
rewards are all equal (:data:`EQUAL_REWARDS_ADVICE`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

FAILED = "failed"  # a receipt's status when its agent or environment gave no reward
ROLLOUT_FAILED = "rollout_failed"  # finalize's reason for such a rollout's row (tasks.finalize.reasons)
FAILED_ADVICE = (
    "check the agent command and its stderr (generate prints its first lines; every failed receipt keeps "
    "them in reward_info.error)"
)
POISONED_ADVICE = (
    "look each reason up in docs/generation.md (failure reasons) and docs/agents.md (the terminal call); "
    "`rollout-ledger status` counts them by reason"
)
EQUAL_REWARDS_ADVICE = "make the task easier or harder, or raise the group size or temperature"


@dataclass(frozen=True)
class RolloutOutcome:
    """One receipted rollout as the summary sees it."""

    group_id: str
    status: str
    reward: float | None
    failure_reason: str | None
    truncated: bool

    @property
    def usable(self) -> bool:
        return self.status == "ok" and self.reward is not None


@dataclass(frozen=True)
class TrainingSignal:
    """``usable`` of ``rollouts`` can be trained on; ``truncated`` of the usable ones hit ``max_tokens`` last.

    ``unusable_by_reason`` counts the others by reason, of which ``failed_by_reason`` those that failed (their
    agent or environment gave no reward; the rest were poisoned, or in a dataset could not be proven).
    ``groups_equal_rewards`` of the ``groups_without_signal`` had two usable rollouts or more, all with one
    reward; the others had fewer than two.
    """

    rollouts: int
    usable: int
    mean_reward: float | None
    groups: int
    groups_without_signal: int
    unusable_by_reason: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    failed_by_reason: dict[str, int] = field(default_factory=dict)
    groups_equal_rewards: int = 0

    @classmethod
    def of(cls, outcomes: Iterable[RolloutOutcome]) -> TrainingSignal:
        outcomes = list(outcomes)
        usable = [o for o in outcomes if o.usable]
        rewards_of: dict[str, list[float]] = {o.group_id: [] for o in outcomes}  # every receipted group counts
        for outcome in usable:
            rewards_of[outcome.group_id].append(float(outcome.reward))  # type: ignore[arg-type]
        flat = sum(1 for rewards in rewards_of.values() if len(rewards) < 2 or len(set(rewards)) == 1)
        equal = sum(1 for rewards in rewards_of.values() if len(rewards) >= 2 and len(set(rewards)) == 1)
        reasons = Counter(o.failure_reason or o.status for o in outcomes if not o.usable)
        failed = Counter(o.failure_reason or o.status for o in outcomes if o.status == FAILED)
        return cls(
            rollouts=len(outcomes),
            usable=len(usable),
            mean_reward=statistics.fmean(float(o.reward) for o in usable) if usable else None,  # type: ignore[arg-type]
            groups=len(rewards_of),
            groups_without_signal=flat,
            unusable_by_reason=dict(sorted(reasons.items())),
            truncated=sum(o.truncated for o in usable),
            failed_by_reason=dict(sorted(failed.items())),
            groups_equal_rewards=equal,
        )

    @classmethod
    def of_dataset_metrics(cls, metrics: Mapping[str, Any]) -> TrainingSignal:
        """The same summary from a finalized dataset's ``metrics.json``."""
        trainable = metrics["trainable_rows"]
        failed = metrics["invalid_reasons"].get(ROLLOUT_FAILED, 0)
        return cls(
            rollouts=metrics["planned_rollouts"],
            usable=trainable,
            mean_reward=(metrics.get("reward") or {}).get("mean"),
            groups=metrics["groups"],
            groups_without_signal=sum(
                metrics[name] for name in ("groups_dropped", "groups_zero_variance", "groups_single_valid")
            ),
            unusable_by_reason=dict(metrics["invalid_reasons"]),
            truncated=round((metrics.get("truncated_rate") or 0.0) * trainable),
            failed_by_reason={ROLLOUT_FAILED: failed} if failed else {},
            groups_equal_rewards=metrics["groups_zero_variance"],
        )

    @property
    def failed(self) -> int:
        """Unusable rollouts that failed: their agent or environment gave no reward."""
        return sum(self.failed_by_reason.values())

    @property
    def poisoned(self) -> int:
        """Unusable rollouts that did not fail: poisoned (in a dataset: or not proven)."""
        return self.rollouts - self.usable - self.failed

    def describe(self) -> list[str]:
        """Plain-language lines for a person reading the end of a run, with advice that follows the cause."""
        if not self.rollouts:
            return ["no rollouts were receipted"]
        mean = "n/a" if self.mean_reward is None else f"{self.mean_reward:.3f}"
        lines = [f"mean reward {mean} over {self.usable} usable of {self.rollouts} rollouts"]
        if self.groups and self.groups_without_signal == self.groups:
            lines.append(
                f"NO TRAINING SIGNAL: all {self.groups} groups have zero reward variance (every advantage is 0); "
                + self._why_no_signal()
            )
        else:
            lines.append(f"{self.groups_without_signal} of {self.groups} groups have zero reward variance (no signal)")
        if self.unusable_by_reason:
            reasons = ", ".join(f"{reason} {count}" for reason, count in self.unusable_by_reason.items())
            lines.append(f"unusable rollouts (masked or dropped in the dataset): {reasons}")
        if self.failed:
            lines.append(f"{self.failed} failed (their agent or environment gave no reward): {FAILED_ADVICE}")
        if self.poisoned > 0:
            lines.append(
                f"{self.poisoned} poisoned (a captured call failed, or the scored call could not be named or proven): "
                + POISONED_ADVICE
            )
        if self.usable:
            lines.append(
                f"truncation rate {self.truncated / self.usable:.1%} (the last call of a usable rollout hit max_tokens)"
            )
        return lines

    def _why_no_signal(self) -> str:
        """Why every group is flat, and what to do: unusable rollouts first (the lines after say why), then rewards."""
        short = self.groups_without_signal - self.groups_equal_rewards
        causes = {FAILED: self.failed, "poisoned": self.poisoned}
        unusable = " and ".join(f"{count} {cause}" for cause, count in causes.items() if count > 0) or "none usable"
        if not short:
            return f"their usable rollouts' rewards are all equal: {EQUAL_REWARDS_ADVICE}"
        if not self.groups_equal_rewards:
            return f"no group has two usable rollouts ({unusable}): see why below"
        return (
            f"{short} of them have fewer than two usable rollouts ({unusable}: see why below), "
            f"{self.groups_equal_rewards} only equal rewards ({EQUAL_REWARDS_ADVICE})"
        )
