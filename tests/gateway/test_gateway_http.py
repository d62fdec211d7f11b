"""The capture gateway over real HTTP with the official ``openai`` client, on loopback.

Behind the gateway is a FAKE answer (``fake_answer``: it echoes what it was asked, no model): these
tests are about the HTTP face only — routes, keys, refusals and their OpenAI error bodies, the
plan's sampling, streaming. The capture path behind it has its own tests.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tasks.gateway.app import Reply, Rollouts
from tasks.gateway.protocol import ChatRequest
from tasks.gateway.server import serving
from tasks.sampling import SamplingSettings

PLAN = SamplingSettings(temperature=0.8, top_p=1.0, max_tokens=32)
TOOL_CALL = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


def fake_answer(asked: list[ChatRequest]):
    """A FAKE capture path: records each request; answers its last message's content reversed, or a tool call."""

    async def answer(request: ChatRequest) -> Reply:
        asked.append(request)
        last = request.messages[-1]["content"]
        if last == "use the tool":
            return Reply(f"c{len(asked)}", None, [TOOL_CALL], "tool_calls", prompt_tokens=7, completion_tokens=5)
        return Reply(f"c{len(asked)}", last[::-1], [], "stop", prompt_tokens=7, completion_tokens=len(last))

    return answer


def client(url: str, rollout_id: str, key: str) -> openai.AsyncOpenAI:
    """The official client on ``rollout_id``'s route with ``key``; no retries, so each refusal is seen once."""
    return openai.AsyncOpenAI(base_url=f"{url}/rollouts/{rollout_id}/v1", api_key=key, max_retries=0)


def run(check) -> list[ChatRequest]:
    """Serve two rollouts (``r1``, ``r2``, 3 calls each) and run ``check(clients, rollouts)``; the requests answered."""
    asked: list[ChatRequest] = []

    async def main() -> None:
        rollouts = Rollouts(model="bundled:smollm2-135m-instruct")
        routes = {r: rollouts.open(r, sampling=PLAN, max_calls=3, answer=fake_answer(asked)) for r in ("r1", "r2")}
        async with serving(rollouts) as url:
            clients = {r: client(url, r, route.key) for r, route in routes.items()}
            await check(clients, rollouts, url)

    asyncio.run(main())
    return asked


def test_a_chat_completion_is_answered_under_the_plans_sampling():
    async def check(clients, rollouts, url):
        reply = await clients["r1"].chat.completions.create(
            model="anything", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        assert reply.choices[0].message.content == "olleh" and reply.choices[0].finish_reason == "stop"
        assert reply.usage.prompt_tokens == 7 and reply.usage.completion_tokens == 5
        assert reply.model == "bundled:smollm2-135m-instruct"
        models = await clients["r1"].models.list()
        assert [m.id for m in models.data] == ["bundled:smollm2-135m-instruct"]

    (asked,) = run(check)
    assert asked.messages == [{"role": "user", "content": "hello"}]
    assert asked.sampling == SamplingSettings(temperature=0.8, top_p=1.0, max_tokens=8)  # lowered, never raised


def test_a_streamed_reply_carries_the_same_text_tool_calls_and_usage():
    async def check(clients, rollouts, url):
        messages = [{"role": "user", "content": "stream me"}]
        stream = await clients["r1"].chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "em maerts" and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == len("stream me")
        stream = await clients["r1"].chat.completions.create(
            model="m", messages=[{"role": "user", "content": "use the tool"}], stream=True
        )
        calls = [d.tool_calls[0] async for c in stream if c.choices and (d := c.choices[0].delta).tool_calls]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]

    assert len(run(check)) == 2


def test_tool_calls_round_trip_in_the_history_the_client_sends_back():
    async def check(clients, rollouts, url):
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
        first = await clients["r1"].chat.completions.create(
            model="m", messages=[{"role": "user", "content": "use the tool"}], tools=tools
        )
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content is None
        history = [
            {"role": "user", "content": "use the tool"},
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "3"},
        ]
        second = await clients["r1"].chat.completions.create(model="m", messages=history, tools=tools)
        assert second.choices[0].message.content == "3"

    first, second = run(check)
    assert first.tools[0]["function"]["name"] == "add" and first.tool_choice == "auto"
    assert second.messages[1] == {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]}
    assert second.messages[2] == {"role": "tool", "tool_call_id": "call_0", "content": "3"}


def test_keys_are_per_rollout_and_a_crossed_key_is_refused_and_counted_never_recorded():
    async def check(clients, rollouts, url):
        crossed = client(url, "r1", clients["r2"].api_key)
        with pytest.raises(openai.AuthenticationError) as refused:
            await crossed.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        assert refused.value.body["message"] == "invalid API key for this route"
        anonymous = client(url, "r1", "guess")
        with pytest.raises(openai.AuthenticationError):
            await anonymous.models.list()
        assert rollouts.auth_failures == 2
        assert rollouts.end("r1").refusals == [] and rollouts.end("r2").refusals == []  # whoever sent them

    assert run(check) == []


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"temperature": 1.0}, "temperature", "differs from the plan's 0.8"),
        ({"max_tokens": 64}, "max_tokens", "above the plan's max_tokens 32"),
        ({"logprobs": True}, "logprobs", "records logprobs itself"),
        ({"n": 2}, "n", "n must be 1"),
        ({"tool_choice": "required"}, "tool_choice", "constrain sampling"),
        ({"stop": ["\n"]}, "stop", "stop strings"),
    ],
)
def test_a_request_outside_the_plan_is_a_400_naming_the_field(extra, param, needle):
    async def check(clients, rollouts, url):
        with pytest.raises(openai.BadRequestError) as refused:
            await clients["r1"].chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], **extra)
        assert refused.value.status_code == 400 and refused.value.param == param and needle in refused.value.message
        assert [r.status for r in rollouts.end("r1").refusals] == [400]

    assert run(check) == []


def test_calls_beyond_the_limit_an_ended_rollout_and_an_unknown_one_are_refused():
    async def check(clients, rollouts, url):
        for _ in range(3):
            await clients["r2"].chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError) as over:
            await clients["r2"].chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert over.value.code == "max_turns_exceeded"
        rollouts.end("r1")
        with pytest.raises(openai.BadRequestError) as ended:
            await clients["r1"].chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert ended.value.code == "rollout_ended"
        stranger = client(url, "r9", clients["r1"].api_key)
        with pytest.raises(openai.AuthenticationError) as unknown:  # as a wrong key: no id is told live
            await stranger.models.list()
        assert unknown.value.code == "invalid_api_key" and rollouts.auth_failures == 1

    assert len(run(check)) == 3


def test_the_final_response_header_is_kept_latest_first_and_a_bad_one_refused():
    async def check(clients, rollouts, url):
        messages = [{"role": "user", "content": "x"}]
        first = await clients["r1"].chat.completions.create(model="m", messages=messages)
        header = {"X-Final-Response-Id": first.id}
        await clients["r1"].chat.completions.create(model="m", messages=messages, extra_headers=header)
        await clients["r2"].models.list(extra_headers={"X-Final-Response-Id": "chatcmpl-c9"})
        await clients["r2"].models.list(extra_headers={"X-Final-Response-Id": "chatcmpl-c10"})
        with pytest.raises(openai.BadRequestError) as refused:
            await clients["r2"].models.list(extra_headers={"X-Final-Response-Id": "x" * 257})
        assert refused.value.code == "invalid_final_response_id"
        r1, r2 = rollouts.end("r1"), rollouts.end("r2")
        assert (r1.final_response_id, r2.final_response_id) == ("chatcmpl-c1", "chatcmpl-c10")
        assert [r.code for r in r2.refusals] == ["invalid_final_response_id"]

    assert len(run(check)) == 2


def test_answers_on_the_wire_hold_exactly_the_fields_the_gateway_sets():
    """What the gateway writes is the ``openai`` types' own dump: set fields only, in the API's names."""

    async def check(clients, rollouts, url):
        messages = [{"role": "user", "content": "use the tool"}]
        raw = await clients["r1"].chat.completions.with_raw_response.create(model="m", messages=messages)
        completion = json.loads(raw.content)
        assert completion == {
            "id": "chatcmpl-c1",
            "object": "chat.completion",
            "created": completion["created"],
            "model": "bundled:smollm2-135m-instruct",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                    "finish_reason": "tool_calls",
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
        }
        headers = {"Authorization": f"Bearer {clients['r1'].api_key}"}
        async with httpx.AsyncClient(base_url=str(clients["r1"].base_url), headers=headers) as plain:
            streamed = await plain.post("chat/completions", json={"messages": messages, "stream": True})
        events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert [c["choices"][0]["delta"] for c in chunks] == [
            {"role": "assistant", "content": ""},
            {"tool_calls": [{"index": 0, **TOOL_CALL}]},
            {},
        ]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and "usage" not in chunks[-1]
        models = json.loads((await clients["r1"].models.with_raw_response.list()).content)
        assert models == {
            "object": "list",
            "data": [
                {
                    "id": "bundled:smollm2-135m-instruct",
                    "object": "model",
                    "created": rollouts.created,
                    "owned_by": "rollout-ledger",
                }
            ],
        }
        with pytest.raises(openai.BadRequestError) as refused:
            await clients["r1"].chat.completions.create(model="m", messages=messages, n=2)
        assert refused.value.response.json() == {
            "error": {
                "message": "n must be 1: each call is one sampled completion in the ledger",
                "type": "invalid_request_error",
                "param": "n",
                "code": None,
            }
        }

    assert len(run(check)) == 2
