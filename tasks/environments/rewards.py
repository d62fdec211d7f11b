"""Named reward functions: score a model reply against a ground-truth string, exactly.

A reward function takes ``(reply, truth)`` and returns a :class:`Score` of 1.0 or 0.0 with
what it read from the reply. It raises ValueError for a ground truth it cannot score (for
example a non-number under ``last_number``), so a data file can be checked before any model
call: score an empty reply against every truth.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from tasks.environments.parsing import last_number as _last_number
from tasks.environments.parsing import parse_number


@dataclass(frozen=True)
class Score:
    """A reward (1.0 correct, 0.0 not) and the answer read from the reply (None: none found)."""

    reward: float
    parsed: str | None


RewardFunction = Callable[[str, str], Score]

_ANSWER_MARKER = re.compile(r"\banswer\s*(?:is\b\s*:?|[:=])", re.IGNORECASE)
_EDGE_CHARS = " \t\r\n.,;:!*$`'\""
_LATEX_SPACING = re.compile(r"\\[!,;:]|\\left|\\right|\s+")


def _normalize_text(text: str) -> str:
    """NFKC, casefold, inner whitespace collapsed, edge punctuation / markdown / ``$`` stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split()).strip(_EDGE_CHARS)


def _nonempty_truth(truth: str, normalized: str, *, reward: str) -> str:
    if not normalized:
        raise ValueError(f"reward {reward!r}: ground truth {truth!r} is empty after normalization")
    return normalized


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, begin = 0, start + len("\\boxed{")
        for position in range(begin, len(text)):
            if text[position] == "{":
                depth += 1
            elif text[position] == "}":
                if depth == 0:
                    return text[begin:position]
                depth -= 1
        start = text.rfind("\\boxed{", 0, start)
    return None


def final_answer(reply: str) -> str:
    """The reply's final answer, stripped: last ``\\boxed{}``, else the rest of the line after the
    last ``answer is`` / ``answer:`` / ``answer =``, else the last non-empty line."""
    boxed = last_boxed(reply)
    if boxed is not None:
        return boxed.strip()
    markers = list(_ANSWER_MARKER.finditer(reply))
    if markers:
        return reply[markers[-1].end() :].split("\n", 1)[0].strip()
    lines = [line for line in reply.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def exact_match(reply: str, truth: str) -> Score:
    """1.0 when the reply's :func:`final_answer`, normalized, equals the normalized truth."""
    expected = _nonempty_truth(truth, _normalize_text(truth), reward="exact_match")
    answer = _normalize_text(final_answer(reply))
    return Score(float(answer == expected), answer or None)


def last_number(reply: str, truth: str) -> Score:
    """1.0 when the last number in the reply equals the number ``truth`` exactly (``42.0`` == ``42``)."""
    expected = parse_number(truth, field="last_number: ground truth")
    found = _last_number(reply)
    if found is None:
        return Score(0.0, None)
    return Score(float(found.value == expected), found.text)


def _normalize_math(text: str) -> str:
    return _LATEX_SPACING.sub("", unicodedata.normalize("NFKC", text)).strip("$.")


def _as_number(text: str) -> Fraction | None:
    try:
        return parse_number(text, field="answer")
    except ValueError:
        return None


def math_boxed(reply: str, truth: str) -> Score:
    """1.0 when the last ``\\boxed{}`` of the reply equals the truth: the same text once spaces,
    LaTeX spacing (``\\!`` ``\\,`` ``\\left`` ``\\right``) and edge ``$`` / ``.`` are removed, or
    the same number when both are plain numbers. No ``\\boxed{}`` scores 0."""
    expected = _nonempty_truth(truth, _normalize_math(truth), reward="math_boxed")
    boxed = last_boxed(reply)
    if boxed is None:
        return Score(0.0, None)
    answer = _normalize_math(boxed)
    same_number = (value := _as_number(answer)) is not None and value == _as_number(expected)
    return Score(float(answer == expected or same_number), answer)


REWARD_FUNCTIONS: Mapping[str, RewardFunction] = {
    "exact_match": exact_match,
    "last_number": last_number,
    "math_boxed": math_boxed,
}


def reward_function(name: str) -> RewardFunction:
    """The reward function registered as ``name``, or a ValueError listing the known names."""
    try:
        return REWARD_FUNCTIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reward function {name!r}; known: {sorted(REWARD_FUNCTIONS)}") from None
