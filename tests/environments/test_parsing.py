"""The shared number rule: lenient (commas, signs, decimals) but deterministic; the answer is the last number."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.environments.parsing import last_assistant_content, last_number, numbers, parse_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", "42"),
        ("x = -5", "-5"),
        ("It costs 1,234.50 dollars", "1234.50"),
        ("5 - 3 = 2", "2"),
        ("10 - 3", "3"),  # a minus separated from its digits is an operator, not a sign
        ("(2)-1", "1"),  # a minus after ')' is an operator
        ("x-7", "7"),  # a minus after a letter is a hyphen
        ("temperature \u22127", "-7"),  # U+2212 minus sign
        ("version 3.5.2", "3.5"),
        ("abc123", "123"),
        ("1,0000", "0000"),  # not a thousands group: two numbers
        ("first 7, then 8", "8"),
    ],
)
def test_last_number_follows_the_documented_rule(text, expected):
    found = last_number(text)
    assert found is not None
    assert found.text == expected
    assert found.value == Fraction(expected)


@pytest.mark.parametrize("text", ["", "no digits here", "- . ,", "minus -"])
def test_text_without_digits_has_no_number(text):
    assert last_number(text) is None


def test_numbers_are_read_left_to_right():
    assert [n.text for n in numbers("1 then 22 then -3.5")] == ["1", "22", "-3.5"]


def test_equal_values_compare_equal_whatever_the_spelling():
    assert parse_number("42", field="t") == parse_number(" 42.00 ", field="t") == parse_number("42.0", field="t")


@pytest.mark.parametrize("bad", ["", "forty", "4 2", "42 apples", "1/2"])
def test_parse_number_refuses_anything_but_one_number_naming_the_field(bad):
    with pytest.raises(ValueError, match="ground truth"):
        parse_number(bad, field="ground truth")


@given(st.integers(min_value=-(10**12), max_value=10**12), st.sampled_from(["{:,}", "{}", "{}.0"]))
def test_any_integer_spelling_parses_to_its_value(value, spelling):
    found = last_number(f"so the result is {spelling.format(value)}.")
    assert found is not None and found.value == value


def test_last_assistant_content_requires_an_assistant_message_last():
    assert last_assistant_content([{"role": "assistant", "content": "hi"}], env="demo") == "hi"
    with pytest.raises(ValueError, match=r"'demo'.*got role 'user'"):
        last_assistant_content([{"role": "user", "content": "hi"}], env="demo")
    with pytest.raises(ValueError, match="got role None"):
        last_assistant_content([], env="demo")
