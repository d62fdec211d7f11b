"""``guess_number``: a multi-turn game; the model guesses a secret integer in ``[lo, hi]``.

Each reply's guess is its last number (:mod:`tasks.environments.parsing`). The environment
answers ``Higher.`` / ``Lower.`` as a user message, asks again for a whole number when a reply
has none (still a turn), and ends with reward 1.0 on the correct guess. An episode cut off
by the turn limit scores 0.0 (no partial credit: closeness is not the task).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tasks.environments.base import Environment, Message, Turn
from tasks.environments.parsing import last_assistant_content, last_number
from tasks.environments.seeding import generate_tasks

MAX_SPAN = 10**12  # hi - lo; keeps the game (and a binary search of it) to a few dozen turns


def _check_bound(value: object, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"environment 'guess_number': option {field} must be an int, got {value!r}")
    return value


def _parsed_guess(reply: str) -> int | None:
    found = last_number(reply)
    if found is None or found.value.denominator != 1:
        return None
    return int(found.value)


def _assistant_turns(messages: Sequence[Message]) -> int:
    return sum(1 for message in messages if message["role"] == "assistant")


class GuessNumber(Environment):
    """Options: ``lo`` and ``hi`` (inclusive bounds of the secret, ints, ``lo < hi``)."""

    name: ClassVar[str] = "guess_number"

    def __init__(self, *, lo: int = 1, hi: int = 100) -> None:
        super().__init__()
        self.lo, self.hi = _check_bound(lo, "lo"), _check_bound(hi, "hi")
        if not 0 < hi - lo <= MAX_SPAN:
            raise ValueError(f"environment 'guess_number': need lo < hi and hi - lo <= {MAX_SPAN}, got [{lo}, {hi}]")

    def options(self) -> dict[str, Any]:
        return {"lo": self.lo, "hi": self.hi}

    def make_tasks(self, num_tasks: int, seed: int) -> list[dict[str, Any]]:
        def build(rng: random.Random) -> dict[str, Any]:
            return {"lo": self.lo, "hi": self.hi, "secret": rng.randint(self.lo, self.hi)}

        return generate_tasks(self.name, num_tasks, seed, build)

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        lo, hi = task["lo"], task["hi"]
        system = (
            f"We are playing a guessing game. I am thinking of a whole number from {lo} to {hi}. "
            "Reply with one guess, a single number. After each guess I say whether my number is higher or lower."
        )
        return [{"role": "system", "content": system}, {"role": "user", "content": f"Guess my number ({lo} to {hi})."}]

    def step(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        guess = _parsed_guess(last_assistant_content(messages, env=self.name))
        secret = task["secret"]
        if guess is None:
            return Turn.reply(
                {"role": "user", "content": f"Please reply with a whole number from {task['lo']} to {task['hi']}."}
            )
        if guess < secret:
            return Turn.reply({"role": "user", "content": f"Higher. My number is greater than {guess}."})
        if guess > secret:
            return Turn.reply({"role": "user", "content": f"Lower. My number is less than {guess}."})
        return Turn.finish(1.0, guess=guess, secret=secret, turns=_assistant_turns(messages))

    def finish_unfinished(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        guesses = [_parsed_guess(m["content"]) for m in messages if m["role"] == "assistant"]
        last_guess = next((guess for guess in reversed(guesses) if guess is not None), None)
        return Turn.finish(
            0.0, truncated=True, secret=task["secret"], last_guess=last_guess, turns=_assistant_turns(messages)
        )
