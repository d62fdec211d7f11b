"""The message graph's matching rules, on plain histories (no engine)."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.capture.graph import (
    COMPACTED_HISTORY,
    HISTORY_REWRITTEN,
    RETRY,
    SUB_AGENT,
    TOOLS_CHANGED,
    CanonicalMessage,
    canonical_conversation,
    canonical_message,
    find_parent,
    root_reason,
    tools_key,
)

SYSTEM = {"role": "system", "content": "You add."}
ASK = {"role": "user", "content": "2 + 3?"}
CALL = {"id": "c0-0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
REPLY = {"role": "assistant", "content": "", "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "c0-0", "content": "5"}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
MUL = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}
NO_TOOLS = tools_key([])


@dataclass(frozen=True)
class Node:
    """An earlier call as matching sees it: its prompt's messages, then its reply, and the tools it offered."""

    conversation: tuple[CanonicalMessage, ...]
    prompt_length: int
    tools: str = NO_TOOLS


def node(*messages: dict, tools: tuple[dict, ...] = ()) -> Node:
    return Node(canonical_conversation(messages), len(messages) - 1, tools_key(tools))


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
    assert find_parent([first, retried], history, NO_TOOLS) is retried
    deeper = node(SYSTEM, ASK, REPLY, RESULT, {"role": "assistant", "content": "5"})
    assert find_parent([first, deeper], canonical_conversation([SYSTEM, ASK, REPLY, RESULT]), NO_TOOLS) is first
    assert find_parent([first], canonical_conversation([SYSTEM, ASK, REPLY]), NO_TOOLS) is None  # not an extension


def test_each_new_root_has_its_reason():
    earlier = [node(SYSTEM, ASK, REPLY), node(SYSTEM, ASK, REPLY, RESULT, {"role": "assistant", "content": "5"})]
    assert root_reason([], canonical_conversation([SYSTEM, ASK]), NO_TOOLS) is None
    assert root_reason(earlier, canonical_conversation([SYSTEM, ASK]), NO_TOOLS) == RETRY
    helper = canonical_conversation([{"role": "system", "content": "You check."}, ASK])
    assert root_reason(earlier, helper, NO_TOOLS) == SUB_AGENT
    summary = canonical_conversation([SYSTEM, {"role": "user", "content": "Summary."}])
    assert root_reason(earlier, summary, NO_TOOLS) == COMPACTED_HISTORY
    edited = [SYSTEM, {"role": "user", "content": "2 + 4?"}, REPLY, RESULT, {"role": "user", "content": "more"}]
    assert root_reason(earlier, canonical_conversation(edited), NO_TOOLS) == HISTORY_REWRITTEN


def test_a_call_offering_other_tools_is_never_spliced_onto_its_history():
    """Tools are part of the graph: the parent's tokens were sampled with its tools in the prompt."""
    first = node(SYSTEM, ASK, REPLY, tools=(ADD,))
    continued = canonical_conversation([SYSTEM, ASK, REPLY, RESULT])
    assert find_parent([first], continued, tools_key([ADD])) is first
    for other in ([ADD, MUL], [MUL], []):  # more tools, other tools, none (tool_choice "none" offers none)
        assert find_parent([first], continued, tools_key(other)) is None
        assert root_reason([first], continued, tools_key(other)) == TOOLS_CHANGED
        assert root_reason([first], canonical_conversation([SYSTEM, ASK]), tools_key(other)) == TOOLS_CHANGED
    assert root_reason([first], canonical_conversation([SYSTEM, ASK]), tools_key([ADD])) == RETRY
    # the same tools however their keys are spelled
    reordered = {"function": {"parameters": {"type": "object"}, "name": "add"}, "type": "function"}
    assert tools_key([reordered]) == tools_key([ADD])
    # a parent offering the same tools wins over a longer one offering others
    longer = node(SYSTEM, ASK, REPLY, RESULT, {"role": "assistant", "content": "5"}, tools=(MUL,))
    history = canonical_conversation([SYSTEM, ASK, REPLY, RESULT, {"role": "assistant", "content": "5"}, ASK])
    assert find_parent([first, longer], history, tools_key([ADD])) is first
