"""guess_number: higher/lower feedback, a re-ask for unparseable replies, 1.0 on a hit, 0.0 when truncated."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.environments.guess_number import MAX_SPAN, GuessNumber


def binary_search_fake_model(lo: int, hi: int):
    """A fake model that narrows [lo, hi] from the environment's Higher/Lower replies and guesses the middle."""

    def reply(history):
        low, high = lo, hi
        for guess_message, answer in zip(history[2::2], history[3::2], strict=True):
            guess = int(guess_message["content"].split()[-1])
            if answer["content"].startswith("Higher"):
                low = guess + 1
            elif answer["content"].startswith("Lower"):
                high = guess - 1
        return f"My guess is {(low + high) // 2}"

    return reply


def test_secrets_lie_within_the_configured_bounds():
    env = GuessNumber(lo=-5, hi=5)
    secrets = [task["secret"] for task in env.make_tasks(300, seed=0)]
    assert min(secrets) == -5 and max(secrets) == 5


def test_feedback_says_higher_or_lower_then_finishes_with_reward_one(play):
    env = GuessNumber(lo=1, hi=100)
    task = {"lo": 1, "hi": 100, "secret": 37}
    script = iter(["50", "I think 25", "37"])
    messages, turn = play(env, task, lambda history: next(script))
    feedback = [m["content"] for m in messages if m["role"] == "user"][1:]
    assert feedback == ["Lower. My number is less than 50.", "Higher. My number is greater than 25."]
    assert turn.reward == 1.0
    assert dict(turn.reward_info) == {"guess": 37, "secret": 37, "turns": 3}


@pytest.mark.parametrize("reply", ["no idea", "maybe 36.5", ""])
def test_unparseable_guess_gets_a_request_for_a_whole_number_and_the_game_goes_on(reply):
    env = GuessNumber()
    task = {"lo": 1, "hi": 100, "secret": 37}
    turn = env.step(task, [*env.initial_messages(task), {"role": "assistant", "content": reply}])
    assert not turn.done
    assert turn.messages == ({"role": "user", "content": "Please reply with a whole number from 1 to 100."},)


def test_truncated_episode_scores_zero_and_records_the_last_guess(play):
    env = GuessNumber()
    task = {"lo": 1, "hi": 100, "secret": 37}
    script = iter(["10", "hmm", "20"])
    _, turn = play(env, task, lambda history: next(script), max_turns=3)
    assert turn.reward == 0.0
    assert dict(turn.reward_info) == {"truncated": True, "secret": 37, "last_guess": 20, "turns": 3}


def test_options_are_recorded():
    assert GuessNumber(lo=-3, hi=9).options() == {"lo": -3, "hi": 9}
    assert GuessNumber().options() == {"lo": 1, "hi": 100}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lo": 5, "hi": 5}, "need lo < hi"),
        ({"lo": 9, "hi": 1}, "need lo < hi"),
        ({"lo": 0, "hi": MAX_SPAN + 1}, "need lo < hi"),
        ({"lo": 1.0}, "option lo must be an int"),
        ({"hi": True}, "option hi must be an int"),
    ],
)
def test_bad_bounds_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        GuessNumber(**options)


@settings(max_examples=60, deadline=None)
@given(
    lo=st.integers(min_value=-(10**6), max_value=10**6),
    span=st.integers(min_value=1, max_value=10**6),
    seed=st.integers(),
)
def test_binary_search_always_wins_within_the_log_bound(play, lo, span, seed):
    env = GuessNumber(lo=lo, hi=lo + span)
    task = env.make_tasks(1, seed)[0]
    bound = math.ceil(math.log2(span + 1)) + 1
    _, turn = play(env, task, binary_search_fake_model(lo, lo + span), max_turns=bound)
    assert turn.reward == 1.0
    assert turn.reward_info["turns"] <= bound
