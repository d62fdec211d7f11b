"""The reference GRPO loss: PPO clipping around the trainer's own step-0 policy, token-level truncated IS.

Three logprobs of each sampled token (``[N, T]`` tensors, any value where ``token_mask`` is 0):

* ``rollout`` (μ): the row's stored logprob, as sampled (docs/contract.md);
* ``proximal`` (π_old): the trainer's logprob of the token before this step's first update, detached;
* ``new`` (π_θ): the trainer's logprob now, with gradient.

Per token: the truncated importance weight ``w = min(exp(proximal - rollout), tis_cap)`` (detached; it corrects
for the sampler not being the trainer: 1 on-policy), the ratio ``r = exp(new - proximal)`` and the clipped
surrogate ``min(r·A, clip(r, 1 - clip_low, 1 + clip_high)·A)`` with the row's advantage ``A``. The loss is
``-sum(w · surrogate · mask) / sum(mask)``: the token mean over every sampled token of every trainable row of
the batch (``token_mask`` is 0 on carried tokens, padding and masked rows). This is verl's token-mean PPO loss
with token-level rollout IS (``rollout_is_threshold = tis_cap``), the shape TRL's and NeMo RL's IS-corrected
losses take too; the exporters (``tasks/trainer/exporters/``) are checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_CLIP = 0.2
DEFAULT_TIS_CAP = 2.0


@dataclass(frozen=True)
class GrpoLossSettings:
    """The step's loss knobs (the defaults are verl's and TRL's)."""

    clip_low: float = DEFAULT_CLIP
    clip_high: float = DEFAULT_CLIP
    tis_cap: float = DEFAULT_TIS_CAP

    def __post_init__(self) -> None:
        if not (0 < self.clip_low < 1 and self.clip_high > 0 and self.tis_cap >= 1):
            raise ValueError(
                f"loss settings need 0 < clip_low < 1, clip_high > 0 and tis_cap >= 1, got {self.clip_low}, "
                f"{self.clip_high}, {self.tis_cap}"
            )


@dataclass(frozen=True)
class GrpoLoss:
    """The loss (scalar, with gradient) and its detached per-token parts, for logging."""

    loss: Any
    tis_weight: Any  # [N, T] w, detached
    ratio: Any  # [N, T] r, detached
    tokens: int  # sampled tokens the mean is over


def grpo_loss(
    new: Any, proximal: Any, rollout: Any, advantages: Any, token_mask: Any, settings: GrpoLossSettings
) -> GrpoLoss:
    """The module docstring's loss over a padded batch; ``advantages`` is ``[N]`` (one per row)."""
    import torch

    mask = token_mask.to(new.dtype)
    zero = torch.zeros_like(new)
    proximal = torch.where(mask > 0, proximal.detach().to(new.dtype), zero)
    rollout = torch.where(mask > 0, rollout.to(new.dtype), zero)
    new = torch.where(mask > 0, new, zero)
    weight = (proximal - rollout).exp().clamp(max=settings.tis_cap)
    ratio = (new - proximal).exp()
    advantage = advantages.to(new.dtype)[:, None]
    clipped = ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    surrogate = torch.minimum(ratio * advantage, clipped * advantage)
    tokens = int(mask.sum().item())
    loss = -(weight * surrogate * mask).sum() / max(tokens, 1)
    return GrpoLoss(loss=loss, tis_weight=weight.detach(), ratio=ratio.detach(), tokens=tokens)
