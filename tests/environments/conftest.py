"""A minimal episode runner for environment tests; the "model" is a scripted fake (a function of the history)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from tasks.environments.base import Environment, Message, Turn

FakeModel = Callable[[list[Message]], str]


def run_episode(
    env: Environment, task: Mapping[str, Any], fake_model: FakeModel, max_turns: int = 20
) -> tuple[list[Message], Turn]:
    """Play one episode: the fake model answers, the environment steps, until done or ``max_turns`` replies."""
    messages = env.initial_messages(task)
    for _ in range(max_turns):
        messages.append({"role": "assistant", "content": fake_model(list(messages))})
        turn = env.step(task, messages)
        if turn.done:
            return messages, turn
        messages = list(turn.rewrite) if turn.rewrite is not None else [*messages, *turn.messages]
    return messages, env.finish_unfinished(task, messages)


@pytest.fixture(scope="session")
def play() -> Callable[..., tuple[list[Message], Turn]]:
    return run_episode
