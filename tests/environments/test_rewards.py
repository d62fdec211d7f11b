"""Named reward functions: exact 1.0 / 0.0 scores, what was parsed, refusal of unscorable truths, the registry."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.environments.rewards import (
    REWARD_FUNCTIONS,
    Score,
    exact_match,
    final_answer,
    last_boxed,
    last_number,
    math_boxed,
    reward_function,
)


@pytest.mark.parametrize(
    ("reply", "answer"),
    [
        ("Let me think.\nThe answer is Paris.", "Paris."),
        ("Final answer: **Paris**", "**Paris**"),
        ("answer = 7\nthanks", "7"),
        ("I will answer this.\nParis", "Paris"),  # "answer" without is/:/= is not a marker
        ("so \\boxed{x^{2}} done", "x^{2}"),
        ("line one\n\n  last line  \n", "last line"),
        ("", ""),
    ],
)
def test_final_answer_prefers_boxed_then_marker_then_last_line(reply, answer):
    assert final_answer(reply) == answer


def test_exact_match_normalizes_case_space_and_edge_punctuation():
    assert exact_match("The answer is:  NEW   york.", "New York") == Score(1.0, "new york")
    assert exact_match("The answer is Boston.", "New York") == Score(0.0, "boston")
    assert exact_match("", "New York") == Score(0.0, None)


def test_last_number_scores_exact_value_equality():
    assert last_number("it is 41, no wait, 42", "42") == Score(1.0, "42")
    assert last_number("42.0", "42") == Score(1.0, "42.0")
    assert last_number("42.5", "42") == Score(0.0, "42.5")
    assert last_number("no idea", "42") == Score(0.0, None)


def test_math_boxed_compares_the_last_box_textually_or_numerically():
    assert math_boxed("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}") == Score(1.0, "\\frac{1}{2}")
    assert math_boxed("\\boxed{ \\left( 1, 2 \\right) }", "(1,2)").reward == 1.0
    assert math_boxed("\\boxed{1,000}", "1000").reward == 1.0
    assert math_boxed("\\boxed{3}", "4") == Score(0.0, "3")
    assert math_boxed("the answer is 4", "4") == Score(0.0, None)


def test_unbalanced_box_is_not_an_answer():
    assert last_boxed("\\boxed{1} and \\boxed{2") == "1"
    assert last_boxed("\\boxed{") is None


@pytest.mark.parametrize(("name", "truth"), [("last_number", "forty-two"), ("exact_match", " . "), ("math_boxed", "$")])
def test_unscorable_ground_truth_is_refused(name, truth):
    with pytest.raises(ValueError, match="ground truth"):
        REWARD_FUNCTIONS[name]("", truth)


def test_registry_resolves_names_and_refuses_unknown_ones_listing_known():
    assert reward_function("math_boxed") is math_boxed
    with pytest.raises(ValueError, match=r"unknown reward function 'f1'.*exact_match"):
        reward_function("f1")


@given(st.integers(min_value=-(10**9), max_value=10**9), st.text(alphabet="abc xyz.!?\n", max_size=40))
def test_last_number_scores_the_truth_one_after_any_digit_free_text(value, prefix):
    assert last_number(f"{prefix} {value}", str(value)).reward == 1.0
    assert last_number(f"{prefix} {value + 1}", str(value)).reward == 0.0
