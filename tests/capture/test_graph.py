"""The message graph's matching rules, on plain histories (no engine)."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.capture.graph import (
    COMPACTED_HISTORY,
    HISTORY_REWRITTEN,
    RETRY,
    SUB_AGENT,
    CanonicalMessage,
    canonical_conversation,
    canonical_message,
    find_parent,
    root_reason,
)

SYSTEM = {"role": "system", "content": "You add."}
ASK = {"role": "user", "content": "2 + 3?"}
CALL = {"id": "c0-0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
REPLY = {"role": "assistant", "content": "", "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "c0-0", "content": "5"}


@dataclass(frozen=True)
class Node:
    """An earlier call as matching sees it: its prompt's messages, then its reply."""

    conversation: tuple[CanonicalMessage, ...]
    prompt_length: int


def node(*messages: dict) -> Node:
    return Node(canonical_conversation(messages), len(messages) - 1)


def test_a_reply_sent_back_as_clients_spell_it_matches_what_the_gateway_returned():
    as_sent = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c0-0", "type": "function", "function": {"name": "add", "arguments": {"b": 3, "a": 2}}}],
    }
    assert canonical_message(as_sent) == canonical_message(REPLY)
    assert canonical_message({**REPLY, "content": "thinking"}) != canonical_message(REPLY)


def test_the_longest_then_latest_extended_call_is_the_parent():
    first = node(SYSTEM, ASK, REPLY)
    retried = node(SYSTEM, ASK, REPLY)
    history = canonical_conversation([SYSTEM, ASK, REPLY, RESULT])
    assert find_parent([first, retried], history) is retried
    deeper = node(SYSTEM, ASK, REPLY, RESULT, {"role": "assistant", "content": "5"})
    assert find_parent([first, deeper], canonical_conversation([SYSTEM, ASK, REPLY, RESULT])) is first
    assert find_parent([first], canonical_conversation([SYSTEM, ASK, REPLY])) is None  # not an extension


def test_each_new_root_has_its_reason():
    earlier = [node(SYSTEM, ASK, REPLY), node(SYSTEM, ASK, REPLY, RESULT, {"role": "assistant", "content": "5"})]
    assert root_reason([], canonical_conversation([SYSTEM, ASK])) is None
    assert root_reason(earlier, canonical_conversation([SYSTEM, ASK])) == RETRY
    helper = canonical_conversation([{"role": "system", "content": "You check."}, ASK])
    assert root_reason(earlier, helper) == SUB_AGENT
    assert root_reason(earlier, canonical_conversation([SYSTEM, {"role": "user", "content": "Summary."}])) == (
        COMPACTED_HISTORY
    )
    edited = [SYSTEM, {"role": "user", "content": "2 + 4?"}, REPLY, RESULT, {"role": "user", "content": "more"}]
    assert root_reason(earlier, canonical_conversation(edited)) == HISTORY_REWRITTEN
