"""Group advantages (docs/architecture.md §8): one value per valid rollout of a group.

Rewards are taken as float64. With ``n`` valid rewards ``r``:

* ``grpo``: ``(r - mean) / (std + 1e-6)``, population std (ddof 0);
* ``dr_grpo``: ``r - mean``;
* ``rloo``: ``r - mean of the other valid rewards`` (equals ``n / (n - 1) * (r - mean)``).

A group with one valid reward, or whose valid rewards are all equal, has no signal: every
advantage is exactly 0 and the outcome says which case happened, so it can be counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.batch_fields import ADVANTAGES

GRPO_EPSILON = 1e-6
OUTCOMES = ("computed", "no_valid", "single_valid", "zero_variance")


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages (float64, aligned with the rewards given) and how they came about (one of ``OUTCOMES``)."""

    values: np.ndarray
    outcome: str


def group_advantages(rewards: np.ndarray | list[float], estimator: str) -> GroupAdvantages:
    """Advantages of the valid rewards of one group under ``estimator`` (one of ``ADVANTAGES``).

    Raises ValueError for an unknown estimator or a non-finite reward: a reward that reaches
    this point has been verified, so a NaN here is a bug upstream, not data to mask.
    """
    if estimator not in ADVANTAGES:
        raise ValueError(f"advantage estimator must be one of {list(ADVANTAGES)}, got {estimator!r}")
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be one-dimensional, got shape {r.shape}")
    if not np.isfinite(r).all():
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    n = r.size
    if n == 0:
        return GroupAdvantages(np.zeros(0, np.float64), "no_valid")
    if n == 1:
        return GroupAdvantages(np.zeros(1, np.float64), "single_valid")
    if (r == r[0]).all():
        return GroupAdvantages(np.zeros(n, np.float64), "zero_variance")
    mean = r.mean()
    if estimator == "grpo":
        values = (r - mean) / (r.std() + GRPO_EPSILON)
    elif estimator == "dr_grpo":
        values = r - mean
    else:
        values = r - (r.sum() - r) / (n - 1)
    return GroupAdvantages(values, "computed")
