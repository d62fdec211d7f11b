"""Group advantages: the three estimators, their no-signal cases, and their algebraic properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.finalize.advantages import GRPO_EPSILON, group_advantages

rewards_lists = st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=2, max_size=16).filter(
    lambda r: len(set(r)) > 1
)


def test_grpo_normalizes_by_population_std_plus_epsilon():
    result = group_advantages([1.0, 0.0, 0.0, 1.0], "grpo")
    assert result.outcome == "computed"
    np.testing.assert_allclose(result.values, np.array([1, -1, -1, 1]) * 0.5 / (0.5 + GRPO_EPSILON))


def test_dr_grpo_is_reward_minus_mean():
    np.testing.assert_allclose(group_advantages([3.0, 1.0, 2.0], "dr_grpo").values, [1.0, -1.0, 0.0])


def test_rloo_subtracts_mean_of_the_other_rows():
    np.testing.assert_allclose(group_advantages([3.0, 1.0, 2.0], "rloo").values, [1.5, -1.5, 0.0])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_single_valid_row_gets_zero_and_says_so(estimator):
    result = group_advantages([0.7], estimator)
    assert result.outcome == "single_valid"
    assert result.values.tolist() == [0.0]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_get_zero_and_say_zero_variance(estimator):
    result = group_advantages([0.1, 0.1, 0.1], estimator)
    assert result.outcome == "zero_variance"
    assert result.values.tolist() == [0.0, 0.0, 0.0]


def test_no_valid_rows_is_its_own_outcome():
    result = group_advantages([], "grpo")
    assert (result.outcome, result.values.size) == ("no_valid", 0)


def test_unknown_estimator_is_refused_by_name():
    with pytest.raises(ValueError, match="'ppo'"):
        group_advantages([1.0, 2.0], "ppo")


def test_non_finite_reward_is_refused():
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")], "grpo")


def test_advantages_are_float64_even_for_float32_rewards():
    result = group_advantages(np.array([1.0, 2.0], np.float32), "dr_grpo")
    assert result.values.dtype == np.float64


@given(rewards_lists)
def test_grpo_advantages_sum_to_zero_with_unit_population_std(rewards):
    values = group_advantages(rewards, "grpo").values
    assert abs(values.sum()) < 1e-6 * len(rewards)
    std = np.asarray(rewards, np.float64).std()
    np.testing.assert_allclose(values.std(), std / (std + GRPO_EPSILON), rtol=1e-9)


@given(rewards_lists)
def test_rloo_is_n_over_n_minus_one_times_dr_grpo(rewards):
    n = len(rewards)
    rloo = group_advantages(rewards, "rloo").values
    dr = group_advantages(rewards, "dr_grpo").values
    np.testing.assert_allclose(rloo, n / (n - 1) * dr, rtol=1e-9, atol=1e-9)


@given(rewards_lists, st.sampled_from(["grpo", "dr_grpo", "rloo"]), st.floats(-50, 50, allow_nan=False, width=32))
def test_advantages_are_invariant_to_a_reward_shift(rewards, estimator, shift):
    shifted = np.asarray(rewards, np.float64) + shift
    if len(set(shifted.tolist())) == 1:
        return  # the shift rounded the rewards together: no signal left to compare
    base = group_advantages(rewards, estimator).values
    np.testing.assert_allclose(group_advantages(shifted, estimator).values, base, rtol=1e-6, atol=1e-6)


@given(rewards_lists, st.floats(0.01, 100, allow_nan=False))
def test_dr_grpo_scales_with_the_rewards(rewards, scale):
    base = group_advantages(rewards, "dr_grpo").values
    scaled = group_advantages(np.asarray(rewards, np.float64) * scale, "dr_grpo").values
    np.testing.assert_allclose(scaled, base * scale, rtol=1e-9, atol=1e-9)
