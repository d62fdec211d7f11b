"""Reading answers out of model text: lenient, deterministic rules shared by every environment.

The number rule (docs/environments.md): an optional minus sign (``-`` or U+2212) directly
before the digits and not after a letter, digit or ``)``; digits, optionally in ``,``-separated
groups of three (``1,234``); an optional ``.`` and more digits. Values are exact
(:class:`fractions.Fraction`), so ``42``, ``42.0`` and ``42.00`` are the same answer.
A reply's answer is its **last** number.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple

from tasks.environments.base import Message

_NUMBER = re.compile(r"(?:(?<![\w)])[-\u2212])?(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?", re.ASCII)


class Number(NamedTuple):
    """A number found in text: its canonical spelling (ASCII minus, no commas) and exact value."""

    text: str
    value: Fraction


def numbers(text: str) -> list[Number]:
    """Every number in ``text``, left to right."""
    found = []
    for match in _NUMBER.finditer(text):
        spelled = match.group().replace("\u2212", "-").replace(",", "")
        found.append(Number(spelled, Fraction(spelled)))
    return found


def last_number(text: str) -> Number | None:
    """The last number in ``text``, or None when it has none."""
    found = numbers(text)
    return found[-1] if found else None


def parse_number(text: str, *, field: str) -> Fraction:
    """``text`` (surrounding whitespace aside) as exactly one number, or a ValueError naming ``field``."""
    match = _NUMBER.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{field} {text!r} is not a number")
    return numbers(match.group())[0].value


def last_assistant_content(messages: Sequence[Message], *, env: str) -> str:
    """The content of the final message, which must be the assistant's (the reply a step answers)."""
    if not messages or messages[-1].get("role") != "assistant":
        role = messages[-1].get("role") if messages else None
        raise ValueError(f"environment {env!r}: step needs an assistant message last, got role {role!r}")
    return messages[-1]["content"]
