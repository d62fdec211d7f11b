"""The environment protocol: how a multi-turn episode talks to the model.

An environment turns a task (a JSON-able dict, generated deterministically from a seed) into
initial chat messages, and after each assistant message answers with a :class:`Turn`: new
user / tool messages to append, or the end of the episode with a reward and reward info.
Environments are stateless between calls: everything an episode needs is in its task and its
message history, so a retried rollout replays identically.

An environment that rewrites earlier history returns ``Turn(rewrite=...)`` with the whole next
conversation; if it does not extend the previous one, the runner applies the batch's
divergence policy (``poison``: the call gets the failure row ``history_diverged``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

Message = dict[str, str]  # {"role": "system"|"user"|"assistant"|"tool", "content": str}
ROLES = ("system", "user", "assistant", "tool")


OPTIONAL_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")  # OpenAI-style tool calling; None: absent
MAX_SHOWN = 200  # characters of an offending value an error message shows


def check_messages(messages: Sequence[Message], *, where: str) -> list[Message]:
    """Messages as a list of ``{"role", "content"}`` dicts, or a ValueError naming ``where``.

    A message may also carry OpenAI-style ``tool_calls`` (a list of ``{"function": {"name": str,
    "arguments": str | dict}}``, with an optional str ``id`` and ``type`` ``"function"``), a str
    ``tool_call_id`` and a str ``name``; any other key, or one of these of the wrong shape, is
    refused rather than handed to a chat template that would drop it silently. Errors show at
    most :data:`MAX_SHOWN` characters of the offending value.
    """
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            raise ValueError(f"{where}: message {index} must be a dict with a role in {ROLES}, got {_shown(message)}")
        role = message["role"]
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {index} ({role}) has no str content")
        unknown = sorted(str(k) for k in message if k not in ("role", "content", *OPTIONAL_MESSAGE_KEYS))
        if unknown:
            raise ValueError(f"{where}: message {index} ({role}) has unknown key(s) {_shown(unknown)}")
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise ValueError(f"{where}: message {index} ({role}) {key} must be a str, got {_shown(message[key])}")
        if message.get("tool_calls") is not None:
            _check_tool_calls(message["tool_calls"], where=f"{where}: message {index} ({role}) tool_calls")
        out.append(dict(message))
    return out


def _check_tool_calls(calls: object, *, where: str) -> None:
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list, got {_shown(calls)}")
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{where}[{index}] must have a function with a non-empty str name, got {_shown(call)}")
        if not isinstance(function.get("arguments", ""), (str, Mapping)):
            raise ValueError(f"{where}[{index}].function.arguments must be a str or a dict")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise ValueError(f"{where}[{index}].id must be a str, got {_shown(call['id'])}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{where}[{index}].type must be 'function', got {_shown(call['type'])}")


def _shown(value: object) -> str:
    """``repr(value)``, cut to :data:`MAX_SHOWN` characters (an environment's output may be huge)."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}... ({len(text)} characters)"


@dataclass(frozen=True)
class Turn:
    """The environment's answer to an assistant message.

    Exactly one of: ``messages`` to append (episode continues), ``rewrite`` (the whole next
    conversation; continues), or ``done`` with ``reward`` (episode over).
    """

    messages: tuple[Message, ...] = ()
    done: bool = False
    reward: float | None = None
    reward_info: Mapping[str, Any] = field(default_factory=dict)
    rewrite: tuple[Message, ...] | None = None

    def __post_init__(self) -> None:
        if self.done:
            if self.reward is None or self.messages or self.rewrite is not None:
                raise ValueError("a finished turn has a reward and no further messages")
        elif not self.messages and self.rewrite is None:
            raise ValueError("an unfinished turn needs messages to append (or a rewrite)")
        elif self.messages and self.rewrite is not None:
            raise ValueError("a turn either appends messages or rewrites the history, not both")

    @classmethod
    def reply(cls, *messages: Message) -> Turn:
        return cls(messages=tuple(messages))

    @classmethod
    def finish(cls, reward: float, **reward_info: Any) -> Turn:
        return cls(done=True, reward=float(reward), reward_info=reward_info)


class Environment(abc.ABC):
    """A multi-turn environment with verifiable rewards. Options come from the batch config."""

    name: ClassVar[str] = "environment"

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"environment {self.name!r} takes no options, got {sorted(options)}")

    @abc.abstractmethod
    def make_tasks(self, num_tasks: int, seed: int) -> list[dict[str, Any]]:
        """``num_tasks`` JSON-able task payloads, a pure function of ``seed``."""

    @abc.abstractmethod
    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        """The conversation the first model call sees."""

    @abc.abstractmethod
    def step(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        """Answer the last assistant message of ``messages`` (the whole history so far)."""

    def finish_unfinished(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        """Score an episode cut off by the turn limit; by default reward 0."""
        return Turn.finish(0.0, truncated=True)

    def options(self) -> dict[str, Any]:
        """The options this instance was built with (recorded in the batch config)."""
        return {}
