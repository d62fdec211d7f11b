"""The reference GRPO loss on hand-checked numbers (tasks/trainer/loss.py)."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.trainer.loss import GrpoLossSettings, grpo_loss


def test_on_policy_the_weights_and_ratios_are_one_and_the_loss_is_minus_the_mean_advantage_per_token():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.0], [0.1, 0.0, 0.0]])).nan_to_num(neginf=0.0)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    new = logp.clone().requires_grad_()
    out = grpo_loss(new, logp, logp, torch.tensor([1.0, -2.0]), mask, GrpoLossSettings())
    assert out.tokens == 3
    assert out.loss.item() == pytest.approx(-(1 + 1 - 2) / 3)
    assert torch.equal(out.tis_weight * mask, mask) and torch.equal(out.ratio * mask, mask)
    out.loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0], [2 / 3, 0.0, 0.0]]))


def test_the_importance_weight_is_truncated_at_the_cap_and_the_ratio_clipped_per_sign_of_the_advantage():
    rollout = torch.log(torch.tensor([[0.1, 0.4]]))
    proximal = torch.log(torch.tensor([[0.5, 0.2]]))  # w = 5 -> capped at 2, and 0.5
    new = torch.log(torch.tensor([[0.75, 0.1]]))  # r = 1.5 and 0.5
    mask = torch.ones(1, 2)
    settings = GrpoLossSettings(clip_low=0.2, clip_high=0.2, tis_cap=2.0)
    positive = grpo_loss(new, proximal, rollout, torch.tensor([1.0]), mask, settings)
    assert positive.loss.item() == pytest.approx(-(2.0 * min(1.5, 1.2) + 0.5 * min(0.5, 0.8)) / 2)
    negative = grpo_loss(new, proximal, rollout, torch.tensor([-1.0]), mask, settings)
    assert negative.loss.item() == pytest.approx(-(2.0 * -1.5 + 0.5 * -0.8) / 2)
    assert negative.tis_weight[0].tolist() == pytest.approx([2.0, 0.5])


def test_masked_positions_contribute_nothing_whatever_they_hold():
    mask = torch.tensor([[1.0, 0.0]])
    junk = torch.tensor([[math.log(0.5), float("nan")]])
    out = grpo_loss(junk.clone(), junk, junk, torch.tensor([1.0]), mask, GrpoLossSettings())
    assert out.loss.item() == pytest.approx(-1.0)


@pytest.mark.parametrize("bad", [{"clip_low": 1.0}, {"clip_high": 0.0}, {"tis_cap": 0.5}])
def test_settings_out_of_range_are_refused_naming_them(bad):
    with pytest.raises(ValueError, match="tis_cap >= 1"):
        GrpoLossSettings(**bad)
