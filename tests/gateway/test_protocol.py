"""What the gateway reads from a chat-completions body, and what it refuses by name."""

from __future__ import annotations

import pytest

from tasks.gateway.limits import GatewayLimits
from tasks.gateway.protocol import GatewayError, read_chat_request
from tasks.sampling import SamplingSettings

PLAN = SamplingSettings(temperature=1.0, top_p=0.9, top_k=20, max_tokens=64)


def test_the_plans_sampling_is_kept_and_max_tokens_only_lowered():
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "top_p": 0.9, "top_k": 20}
    assert read_chat_request(body, PLAN).sampling == PLAN
    lowered = read_chat_request(body | {"max_completion_tokens": 10, "max_tokens": 12}, PLAN)
    assert lowered.sampling.max_tokens == 10
    assert read_chat_request(body | {"seed": 7, "user": "u", "stream": True}, PLAN).stream


def test_text_parts_are_joined_and_a_null_content_beside_tool_calls_is_empty():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [call], "name": None},
        ]
    }
    assert read_chat_request(body, PLAN).messages == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ([], None, "must be a JSON object"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "role in"),
        ({"messages": [{"role": "user", "content": None}]}, "messages", "no str content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "only text content"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", "positive integer"),
        ({"messages": [{"role": "user", "content": "x"}], "top_k": 5}, "top_k", "differs from the plan's 20"),
        ({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "frobnicate", "unrecognized"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}, "tools", "tools[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions", "send tools"),
    ],
)
def test_a_bad_or_unsupported_body_is_refused_naming_the_field(body, param, needle):
    with pytest.raises(GatewayError) as refused:
        read_chat_request(body, PLAN)
    assert refused.value.status == 400 and refused.value.param == param and needle in refused.value.message
    assert refused.value.body()["error"]["type"] == "invalid_request_error"


LIMITS = GatewayLimits(max_messages=3, max_tools=1, max_message_chars=10, max_total_chars=15)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"messages": ["not a message"] * 4}, "too_many_messages"),  # counted before any message is checked
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{}, {}]}, "too_many_tools"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 11}]}]}, "message_too_long"),
        ({"messages": [{"role": "user", "content": "x" * 8}] * 2}, "messages_too_long"),
    ],
)
def test_a_body_over_the_limits_is_refused_with_its_code(body, code):
    with pytest.raises(GatewayError) as refused:
        read_chat_request(body, PLAN, LIMITS)
    assert (refused.value.status, refused.value.code) == (400, code)


def test_a_body_at_the_limits_is_read():
    body = {"messages": [{"role": "user", "content": "x" * 10}, {"role": "user", "content": "y" * 5}]}
    assert (
        len(read_chat_request(body | {"tools": [{"type": "function", "function": {"name": "f"}}]}, PLAN, LIMITS).tools)
        == 1
    )
