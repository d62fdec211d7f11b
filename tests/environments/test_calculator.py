"""calculator: <calc> tool calls answered by tool messages, safe exact evaluation, exact final scoring."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.environments.calculator import (
    MAX_CALLS_PER_MESSAGE,
    MAX_EXPRESSION_CHARS,
    PROBLEMS,
    SYSTEM_PROMPT,
    Calculator,
    CalculatorError,
    ToolCall,
    answer_call,
    evaluate,
    format_number,
    read_tool_calls,
)

ENV = Calculator()
TASK = {"kind": "crates", "question": "How many?", "answer": 417}


def tool_using_fake_model(history):
    """A fake model that asks the calculator first, then answers with the number the tool returned."""
    if history[-1]["role"] == "tool":
        return f"The calculator says {history[-1]['content'].split('=')[-1].strip()}, so the answer is that."
    return "Let me compute: <calc>17 * 24 + 9</calc>"


def test_system_prompt_documents_the_tool_call_format():
    assert "<calc>EXPRESSION</calc>" in SYSTEM_PROMPT
    assert ENV.initial_messages(TASK)[0] == {"role": "system", "content": SYSTEM_PROMPT}


def test_every_problem_kind_is_generated_with_a_positive_integer_answer():
    tasks = ENV.make_tasks(200, seed=2)
    assert {task["kind"] for task in tasks} == set(PROBLEMS)
    assert all(isinstance(task["answer"], int) and task["answer"] > 0 for task in tasks)


def test_tool_call_is_answered_then_the_final_reply_is_scored(play):
    messages, turn = play(ENV, TASK, tool_using_fake_model)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[3] == {"role": "tool", "content": "17 * 24 + 9 = 417"}
    assert turn.reward == 1.0
    assert dict(turn.reward_info) == {"parsed": "417", "truth": 417, "tool_calls": 1}


def test_reply_without_a_tool_call_is_the_final_answer(play):
    _, turn = play(ENV, TASK, lambda history: "It is 416.")
    assert turn.reward == 0.0
    assert dict(turn.reward_info) == {"parsed": "416", "truth": 417, "tool_calls": 0}


def test_several_calls_get_one_tool_message_each_in_order_and_excess_calls_an_error():
    reply = "".join(f"<calc>{i} + 1</calc>" for i in range(MAX_CALLS_PER_MESSAGE + 1))
    turn = ENV.step(TASK, [*ENV.initial_messages(TASK), {"role": "assistant", "content": reply}])
    contents = [m["content"] for m in turn.messages]
    assert contents[:MAX_CALLS_PER_MESSAGE] == [f"{i} + 1 = {i + 1}" for i in range(MAX_CALLS_PER_MESSAGE)]
    assert contents[-1] == f"error: at most {MAX_CALLS_PER_MESSAGE} calculator calls per message"


def test_refused_expression_is_answered_with_an_error_message_not_raised():
    turn = ENV.step(TASK, [{"role": "assistant", "content": "<calc>__import__('os')</calc>"}])
    assert turn.messages == ({"role": "tool", "content": "error: function calls are not allowed"},)


def test_tags_are_case_insensitive_and_may_span_lines():
    calls = read_tool_calls({"role": "assistant", "content": "<CALC>1 +\n2</Calc> and <calc>3</calc>"})
    assert [call.expression for call in calls] == ["1 +\n2", "3"]


def test_structured_tool_calls_are_read_and_their_ids_echoed():
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}},
            {"id": "c2", "type": "function", "function": {"name": "search", "arguments": {"query": "x"}}},
        ],
    }
    calls = read_tool_calls(message)
    assert calls == [ToolCall("calculator", "6*7", "c1"), ToolCall("search", "", "c2")]
    turn = ENV.step(TASK, [message])
    assert turn.messages == (
        {"role": "tool", "content": "6*7 = 42", "tool_call_id": "c1"},
        {
            "role": "tool",
            "content": "error: unknown tool 'search'; the only tool is 'calculator'",
            "tool_call_id": "c2",
        },
    )


def test_truncated_episode_scores_zero_and_counts_tool_calls(play):
    _, turn = play(ENV, TASK, lambda history: "<calc>1+1</calc>", max_turns=3)
    assert turn.reward == 0.0
    assert dict(turn.reward_info) == {"truncated": True, "truth": 417, "tool_calls": 3}


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("-3 // 2", -2),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("2 ** -2", Fraction(1, 4)),
        ("0.1 + 0.2", Fraction(3, 10)),  # exact decimals, no float error
        ("--5", 5),
        ("+5", 5),
        ("10 / 4", Fraction(5, 2)),
    ],
)
def test_evaluate_computes_exact_values(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("x + 1", "name_not_allowed"),
        ("__import__('os').system('true')", "call_not_allowed"),
        ("abs(-1)", "call_not_allowed"),
        ("(1).real", "attribute_not_allowed"),
        ("'a' * 3", "constant_not_allowed"),
        ("True + 1", "constant_not_allowed"),
        ("1j", "constant_not_allowed"),
        ("[1, 2]", "syntax_not_allowed"),
        ("lambda: 1", "syntax_not_allowed"),
        ("1 if 1 else 2", "syntax_not_allowed"),
        ("1 < 2", "syntax_not_allowed"),
        ("1 << 2", "syntax_not_allowed"),
        ("~1", "syntax_not_allowed"),
        ("2 ** 65", "exponent_too_large"),
        ("9 ** 9 ** 9", "exponent_too_large"),
        ("10 ** 10 ** 10 ** 10", "exponent_too_large"),
        ("2 ** 0.5", "exponent_not_integer"),
        ("10 ** 16", "out_of_range"),
        ("(10 ** 15) ** 64", "out_of_range"),
        ("1e400", "out_of_range"),
        ("99999999999999999999", "out_of_range"),
        ("1 / 0", "division_by_zero"),
        ("1 % 0", "division_by_zero"),
        ("0 ** -1", "division_by_zero"),
        ("1 +", "syntax_error"),
        ("", "syntax_error"),
        ("1; 2", "syntax_error"),
        ("(" * 150 + "1" + ")" * 150, "too_long"),
    ],
)
def test_evaluate_refuses_unsafe_or_unbounded_expressions_with_a_named_reason(expression, reason):
    with pytest.raises(CalculatorError) as refused:
        evaluate(expression)
    assert refused.value.reason == reason


def test_expression_length_limit_is_inclusive():
    assert evaluate("1+" * ((MAX_EXPRESSION_CHARS - 1) // 2) + "1") == (MAX_EXPRESSION_CHARS - 1) // 2 + 1


@pytest.mark.parametrize(
    ("value", "text"), [(Fraction(14), "14"), (Fraction(-5, 2), "-2.5"), (Fraction(7, 3), "2.33333333333")]
)
def test_results_are_shown_as_integers_or_rounded_decimals(value, text):
    assert format_number(value) == text


def test_answer_call_formats_results_and_errors():
    assert answer_call(ToolCall("calculator", " 1/8 "), 0) == {"role": "tool", "content": "1/8 = 0.125"}
    assert answer_call(ToolCall("calculator", "1/0"), 0) == {"role": "tool", "content": "error: division by zero"}


# six leaves of |n| <= 300: every value stays below the calculator's range (300**6 < MAX_MAGNITUDE)
_LEAVES = st.integers(min_value=-300, max_value=300).map(lambda n: (str(n) if n >= 0 else f"({n})", Fraction(n)))
_OPERATORS = {"+": Fraction.__add__, "-": Fraction.__sub__, "*": Fraction.__mul__}


def _combine(children):
    return st.tuples(children, st.sampled_from(sorted(_OPERATORS)), children).map(
        lambda t: (f"({t[0][0]} {t[1]} {t[2][0]})", _OPERATORS[t[1]](t[0][1], t[2][1]))
    )


@given(st.recursive(_LEAVES, _combine, max_leaves=6))
def test_evaluate_agrees_with_exact_arithmetic_on_random_expressions(expression_and_value):
    expression, value = expression_and_value
    assert evaluate(expression) == value
