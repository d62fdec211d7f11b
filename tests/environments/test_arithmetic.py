"""arithmetic: single turn, exact integer answer, reward by the last number of the reply."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.environments.arithmetic import PROBLEMS, Arithmetic
from tasks.environments.base import check_messages

ENV = Arithmetic()


def test_every_problem_kind_is_generated_with_an_integer_answer_in_its_question():
    tasks = ENV.make_tasks(200, seed=1)
    assert {task["kind"] for task in tasks} == set(PROBLEMS)
    assert all(isinstance(task["answer"], int) and task["answer"] > 0 for task in tasks)


def test_initial_messages_are_a_system_prompt_and_the_question():
    task = ENV.make_tasks(1, seed=3)[0]
    messages = check_messages(ENV.initial_messages(task), where="test")
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"] == task["question"]


def test_correct_reply_scores_one_and_records_parsed_and_truth(play):
    task = ENV.make_tasks(1, seed=3)[0]
    messages, turn = play(ENV, task, lambda history: f"Let me compute. The answer is {task['answer']}.")
    assert len(messages) == 3
    assert (turn.done, turn.reward) == (True, 1.0)
    assert dict(turn.reward_info) == {"parsed": str(task["answer"]), "truth": task["answer"]}


def test_the_last_number_is_the_answer_not_an_earlier_one(play):
    task = ENV.make_tasks(1, seed=3)[0]
    _, turn = play(ENV, task, lambda history: f"{task['answer']}? No: {task['answer'] + 1}")
    assert turn.reward == 0.0
    assert turn.reward_info["parsed"] == str(task["answer"] + 1)


def test_reply_without_a_number_scores_zero_with_nothing_parsed(play):
    _, turn = play(ENV, ENV.make_tasks(1, seed=3)[0], lambda history: "I do not know.")
    assert (turn.reward, turn.reward_info["parsed"]) == (0.0, None)


def test_arithmetic_takes_no_options():
    with pytest.raises(TypeError, match=r"takes no options, got \[.max_value.\]"):
        Arithmetic(max_value=3)
    assert ENV.options() == {}


@given(seed=st.integers(), index=st.integers(min_value=0, max_value=20), style=st.sampled_from(["{}", "= {}.", "{:,}"]))
def test_the_true_answer_always_scores_one(seed, index, style):
    task = ENV.make_tasks(index + 1, seed)[index]
    reply = f"Working it out... {style.format(task['answer'])}"
    turn = ENV.step(task, [*ENV.initial_messages(task), {"role": "assistant", "content": reply}])
    assert turn.reward == 1.0
