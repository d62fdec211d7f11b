"""Tools offered to a template without tools, and tool calls read back with vLLM's hermes parser (real tokenizer)."""

from __future__ import annotations

import json

import pytest

from tasks.gateway.tools import CALL_START, ToolCallReader, call_text, offer_tools, tools_prompt

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def reader(tokenizer):
    return ToolCallReader(tokenizer)


def test_the_tools_go_into_the_system_message_the_same_way_every_call():
    user = [{"role": "user", "content": "2+3?"}]
    offered = offer_tools(user, [ADD])
    assert offered[0] == {"role": "system", "content": tools_prompt([ADD])} and offered[1:] == user
    assert json.dumps(ADD, sort_keys=True) in offered[0]["content"]
    system = [{"role": "system", "content": "Be brief."}, *user]
    assert offer_tools(system, [ADD])[0]["content"] == f"Be brief.\n\n{tools_prompt([ADD])}"
    assert offer_tools(user, []) == user and offer_tools(system, [ADD]) == offer_tools(system, [ADD])


def test_the_offer_renders_in_the_bundled_template(tokenizer):
    text = tokenizer.apply_chat_template(offer_tools([{"role": "user", "content": "hi"}], [ADD]), tokenize=False)
    assert "<tools>" in text and '"name": "add"' in text and "<tool_call>" in text


def test_a_tool_call_is_read_with_a_stable_id_and_the_text_before_it_as_content(reader):
    sampled = 'I will add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    reply = reader.read(sampled, call_id="r0-c1")
    assert reply.content == "I will add." and not reply.unparsed
    assert reply.tool_calls == [
        {"id": "r0-c1-0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    ]
    assert (
        reader.read(call_text(reply.tool_calls[0]), call_id="x").tool_calls[0]["function"]
        == reply.tool_calls[0]["function"]
    )


def test_plain_text_is_content_and_an_unreadable_call_is_unparsed_text_never_a_guess(reader):
    assert reader.read("5", call_id="c").content == "5"
    broken = f'{CALL_START}{{"name": add}}</tool_call>'
    reply = reader.read(broken, call_id="c")
    assert (reply.content, reply.tool_calls, reply.unparsed) == (broken, [], True)
