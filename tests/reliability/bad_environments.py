"""Environments that misbehave on purpose (loaded by import path): fakes for the bad-input corpus.

:class:`MalformedOutputEnvironment` is a one-turn game whose option ``case`` picks what it gets
wrong: the initial messages or the reply to the first assistant message. No real environment
ships these outputs; the generate stage must turn each into a named failure row or receipt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tasks.environments.base import Environment, Message, Turn

HUGE = "ha " * 60_000  # ~60k tokens: far over any test engine's context
BAD_INITIAL: dict[str, Any] = {
    "int_content": [{"role": "user", "content": 42}],
    "none_content": [{"role": "user", "content": None}],
    "parts_content": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    "no_role": [{"content": "hi"}],
    "unknown_role": [{"role": "robot", "content": "hi"}],
    "not_a_dict": ["hi"],
    "huge_bad_role": [{"role": "x" * 100_000, "content": "hi"}],
    "huge_message": [{"role": "user", "content": HUGE}],
}
BAD_REPLY: dict[str, Any] = {
    "reply_int_content": [{"role": "user", "content": 7}],
    "tool_calls_not_a_list": [{"role": "assistant", "content": "", "tool_calls": "calculator(1+1)"}],
    "tool_call_without_function": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}],
    "tool_call_name_not_str": [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": 3}}]}
    ],
    "tool_call_id_not_str": [{"role": "tool", "content": "2", "tool_call_id": ["c1"]}],
    "unknown_message_key": [{"role": "user", "content": "go on", "metadata": {"secret": 1}}],
    "huge_reply": [{"role": "user", "content": HUGE}],
}


class MalformedOutputEnvironment(Environment):
    """One task per index; ``case`` (a key of :data:`BAD_INITIAL` or :data:`BAD_REPLY`) says what goes wrong."""

    name: ClassVar[str] = "malformed-output"

    def __init__(self, case: str) -> None:
        if case not in BAD_INITIAL and case not in BAD_REPLY:
            raise ValueError(f"unknown case {case!r}")
        self.case = case

    def options(self) -> dict[str, Any]:
        return {"case": self.case}

    def make_tasks(self, num_tasks: int, seed: int) -> list[dict[str, Any]]:
        return [{"index": i} for i in range(num_tasks)]

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        if self.case in BAD_INITIAL:
            return BAD_INITIAL[self.case]
        return [{"role": "user", "content": f"Task {task['index']}: say a number."}]

    def step(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        if sum(m["role"] == "assistant" for m in messages) == 1:
            return Turn(messages=tuple(BAD_REPLY[self.case]))
        return Turn.finish(1.0)
