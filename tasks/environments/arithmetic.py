"""``arithmetic``: single-turn word problems with one operation and an exact integer answer.

Task ``i`` is drawn from its own seeded stream (:mod:`tasks.environments.seeding`). The reply
is scored by the last number it contains (:func:`tasks.environments.rewards.last_number`):
1.0 when it equals the answer exactly, else 0.0.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from tasks.environments.base import Environment, Message, Turn
from tasks.environments.parsing import last_assistant_content
from tasks.environments.rewards import last_number
from tasks.environments.seeding import generate_tasks

SYSTEM_PROMPT = "Solve the math problem. End your reply with the final answer as a single number."
NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jon")
ITEMS = ("apple", "pencil", "marble", "sticker", "book", "card", "coin", "shell")


def _add(rng: random.Random, name: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    return f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?", a + b


def _subtract(rng: random.Random, name: str, item: str) -> tuple[str, int]:
    b = rng.randint(1, 19)
    a = rng.randint(b + 1, 30)
    return f"{name} has {a} {item}s and gives {b} away. How many {item}s does {name} have left?", a - b


def _multiply(rng: random.Random, name: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return f"{name} fills {a} bags with {b} {item}s each. How many {item}s is that in total?", a * b


def _divide(rng: random.Random, name: str, item: str) -> tuple[str, int]:
    friends, each = rng.randint(2, 9), rng.randint(2, 12)
    question = f"{name} shares {friends * each} {item}s equally among {friends} friends."
    return f"{question} How many {item}s does each friend get?", each


PROBLEMS: Mapping[str, Callable[[random.Random, str, str], tuple[str, int]]] = {
    "add": _add,
    "subtract": _subtract,
    "multiply": _multiply,
    "divide": _divide,
}


def _build_task(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(sorted(PROBLEMS))
    question, answer = PROBLEMS[kind](rng, rng.choice(NAMES), rng.choice(ITEMS))
    return {"kind": kind, "question": question, "answer": answer}


class Arithmetic(Environment):
    """One question, one reply, reward 1.0 iff the reply's last number is the answer."""

    name: ClassVar[str] = "arithmetic"

    def make_tasks(self, num_tasks: int, seed: int) -> list[dict[str, Any]]:
        return generate_tasks(self.name, num_tasks, seed, _build_task)

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]

    def step(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        score = last_number(last_assistant_content(messages, env=self.name), str(task["answer"]))
        return Turn.finish(score.reward, parsed=score.parsed, truth=task["answer"])
