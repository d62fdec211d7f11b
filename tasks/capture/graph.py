"""The message graph of a rollout: which earlier call a request's history continues (docs/agents.md).

An agent sends its whole history with every call. A request whose messages extend, exactly, the
conversation an earlier call saw plus that call's reply, and that offers the model the same tools,
is that call's child: its prompt reuses the parent's exact tokens (the splice). Any other request
starts a new root, and :func:`root_reason` names why, from the earlier calls alone:

* ``retry``: the same messages and tools as an earlier root call (a call the client sent again);
* ``tools_changed``: it would extend (or repeat) an earlier call, but the tools it offers differ
  (another ``tools`` list, or ``tool_choice`` turning them off or on): the parent's tokens were
  sampled with other tools in the prompt, so the model must see this request's tools rendered afresh;
* ``sub_agent``: a first message no earlier call began with (another agent, its own history);
* ``compacted_history``: fewer messages than the longest earlier conversation (summarized or cut);
* ``history_rewritten``: anything else (earlier messages edited);
* ``independent``: every call after the first, under the batch's ``message_graph: independent``
  (each call's prompt is its whole history rendered afresh, as a plain server would prompt it).

Messages are compared in a canonical form (:func:`canonical_message`), so that what a client
sends back as an earlier reply (``content: null`` beside tool calls, arguments as a JSON string
or object) matches what the gateway returned; tools by :func:`tools_key`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

RETRY = "retry"
TOOLS_CHANGED = "tools_changed"
SUB_AGENT = "sub_agent"
COMPACTED_HISTORY = "compacted_history"
HISTORY_REWRITTEN = "history_rewritten"
INDEPENDENT = "independent"
ROOT_REASONS = (RETRY, TOOLS_CHANGED, SUB_AGENT, COMPACTED_HISTORY, HISTORY_REWRITTEN, INDEPENDENT)

CanonicalMessage = tuple[Any, ...]


class GraphNode(Protocol):
    """What matching reads of an earlier call: the messages it saw, then its reply, and the tools it offered."""

    @property
    def conversation(self) -> tuple[CanonicalMessage, ...]: ...

    @property
    def prompt_length(self) -> int: ...

    @property
    def tools(self) -> str: ...


N = TypeVar("N", bound=GraphNode)


def canonical_message(message: Mapping[str, Any]) -> CanonicalMessage:
    """A message as a hashable tuple that ignores how a client spells the same content."""
    calls = tuple(
        (
            call.get("id"),
            call["function"]["name"],
            _canonical_arguments(call["function"].get("arguments")),
        )
        for call in message.get("tool_calls") or ()
    )
    return (message["role"], message.get("content") or "", calls, message.get("tool_call_id"), message.get("name"))


def canonical_conversation(messages: Iterable[Mapping[str, Any]]) -> tuple[CanonicalMessage, ...]:
    return tuple(canonical_message(m) for m in messages)


def tools_key(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools a call offers the model, as a digest: equal for the same tools however their keys are ordered."""
    return hashlib.sha256(json.dumps(list(tools), sort_keys=True).encode()).hexdigest()


def _canonical_arguments(arguments: object) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments if arguments is not None else {}, sort_keys=True)


def find_parent(nodes: Sequence[N], messages: tuple[CanonicalMessage, ...], tools: str) -> N | None:
    """The earlier call offering ``tools`` whose conversation ``messages`` extends by a message or more:
    the longest, then the latest."""
    best: N | None = None
    for node in nodes:
        if (
            node.tools == tools
            and _extends(messages, node)
            and (best is None or len(node.conversation) >= len(best.conversation))
        ):
            best = node
    return best


def root_reason(nodes: Sequence[GraphNode], messages: tuple[CanonicalMessage, ...], tools: str) -> str | None:
    """Why ``messages`` offering ``tools`` start a new root (None for the rollout's first call), given that they
    extend no call offering the same tools."""
    if not nodes:
        return None
    if any(node.tools == tools and node.conversation[: node.prompt_length] == messages for node in nodes):
        return RETRY
    if any(_extends(messages, node) or node.conversation[: node.prompt_length] == messages for node in nodes):
        return TOOLS_CHANGED  # it would continue or repeat that call, with other tools
    if all(node.conversation[0] != messages[0] for node in nodes):
        return SUB_AGENT
    if len(messages) < max(len(node.conversation) for node in nodes):
        return COMPACTED_HISTORY
    return HISTORY_REWRITTEN


def _extends(messages: tuple[CanonicalMessage, ...], node: GraphNode) -> bool:
    seen = node.conversation
    return len(seen) < len(messages) and messages[: len(seen)] == seen
