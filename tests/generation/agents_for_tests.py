"""Agents the generate tests run behind the capture gateway: real agents on the official ``openai`` client.

Nothing here is faked: each agent is what a user would write against an OpenAI-style client
(the engine behind the gateway is the test's own, fake or real). Each exercises one shape of
message graph: tool calls, a retried call, a sub-agent, a compacted history.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from examples.callable_agent import solve
from tasks.environments.agents import Agent, AgentDoor, AgentResult

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
SYSTEM = "You are a careful assistant. Use the add tool to add numbers."


def question(task: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]


def as_history(message: Any) -> dict[str, Any]:
    """An assistant reply as the next request's history holds it (as clients do: the SDK's own dump)."""
    return message.model_dump(exclude_none=True)


def scored(task: dict[str, Any], text: str | None) -> dict[str, Any]:
    return {"reward": float(str(task["a"] + task["b"]) in (text or "")), "final_output": text or ""}


async def tool_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Calls the add tool as the model asks, until the model answers in text."""
    messages = question(task)
    for _ in range(4):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
        message = reply.choices[0].message
        messages.append(as_history(message))
        if not message.tool_calls:
            return scored(task, message.content)
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
    return {"reward": 0.0}


async def retrying_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Sends its first call twice (a client retry after a lost answer), then continues from the second answer."""
    messages = question(task)
    await client.chat.completions.create(model="policy", messages=messages)  # abandoned
    reply = await client.chat.completions.create(model="policy", messages=messages)
    messages += [as_history(reply.choices[0].message), {"role": "user", "content": "Say it again."}]
    await client.chat.completions.create(model="policy", messages=messages)  # abandoned too
    final = await client.chat.completions.create(model="policy", messages=messages)
    return scored(task, final.choices[0].message.content) | {"response_id": final.id}


async def sub_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Asks a helper agent (its own system prompt and history) and hands its answer back to the main history."""
    messages = question(task)
    first = await client.chat.completions.create(model="policy", messages=messages)
    helper = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "system", "content": "You check sums."}, {"role": "user", "content": "Is addition easy?"}],
    )
    messages += [
        as_history(first.choices[0].message),
        {"role": "user", "content": f"A checker says: {helper.choices[0].message.content}"},
    ]
    final = await client.chat.completions.create(model="policy", messages=messages)
    return scored(task, final.choices[0].message.content)


# Seconds the first of concurrent_agent's sub-agents waits before each of its calls: a test sets it to make the
# second's calls arrive first.
FIRST_SUB_AGENT_DELAY_S = 0.0


async def concurrent_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Two sub-agents at once (``asyncio.gather``), each three calls extending its own history; the main agent
    scores the first's last answer and names it (``response_id``: with two chains, the last call is no witness).
    Which sub-agent's call reaches the gateway first is up to the event loop."""

    async def sub_agent(name: str, opening: str, delay: float) -> Any:
        messages = [{"role": "system", "content": f"You are {name}."}, {"role": "user", "content": opening}]
        reply = None
        for follow_up in ("Check it.", "Final answer?", None):
            await asyncio.sleep(delay)
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages.append(as_history(reply.choices[0].message))
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
        return reply

    adder, _ = await asyncio.gather(
        sub_agent("the adder", f"What is {task['a']} + {task['b']}?", FIRST_SUB_AGENT_DELAY_S),
        sub_agent("the multiplier", f"What is {task['a']} * {task['b']}?", 0.0),
    )
    return scored(task, adder.choices[0].message.content) | {"response_id": adder.id}


async def compacting_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """After two turns, replaces its history by a summary (as agents do when the context fills up)."""
    messages = question(task)
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [as_history(reply.choices[0].message), {"role": "user", "content": "Go on."}]
    summary = [messages[0], {"role": "user", "content": f"Summary so far: {messages[1]['content']}"}]
    final = await client.chat.completions.create(model="policy", messages=summary)
    return scored(task, final.choices[0].message.content)


async def header_declaring_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Asks twice, then names its first answer as the scored one in the gateway's final-response header.

    With an odd ``a`` its result names the second answer as well: the two declarations disagree.
    """
    messages = question(task)
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [as_history(first.choices[0].message), {"role": "user", "content": "Are you sure?"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    await client.models.list(extra_headers={"X-Final-Response-Id": first.id})
    result = scored(task, first.choices[0].message.content)
    return result | {"response_id": second.id} if task["a"] % 2 else result


# The agents of the e2e batch on the real model (tests/generation/test_agents_e2e.py), one shape per task.
KEYS_SEEN: dict[str, str] = {}  # key -> base URL of every rollout that ran in this process: one agent misuses another's


async def streaming_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Two turns, each answer read as server-sent events."""
    messages = question(task)
    text = ""
    for follow_up in ("Are you sure?", None):
        stream = await client.chat.completions.create(model="policy", messages=messages, stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        messages.append({"role": "assistant", "content": text})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return scored(task, text)


async def crossing_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """First calls with another rollout's key (refused with 401), then with its own."""
    import asyncio

    import openai

    for _ in range(200):  # until another rollout's agent has started
        other = next((key for key, url in KEYS_SEEN.items() if url != str(client.base_url)), None)
        if other is not None:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("no other rollout's key to misuse")
    try:
        await client.with_options(api_key=other).chat.completions.create(model="policy", messages=question(task))
        raise AssertionError("a call with another rollout's key was answered")
    except openai.AuthenticationError:
        pass
    return await tool_agent(client, task)


async def crashing_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Makes a call, then its own code fails."""
    await client.chat.completions.create(model="policy", messages=question(task))
    raise RuntimeError("the agent's tool crashed")


async def hanging_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Makes a call, then waits forever (the batch's timeout_s ends it)."""
    import asyncio

    await client.chat.completions.create(model="policy", messages=question(task))
    await asyncio.sleep(3600)
    return {"reward": 1.0}


async def silent_agent(client: Any, task: dict[str, Any]) -> None:
    """Makes a call and returns no reward."""
    await client.chat.completions.create(model="policy", messages=question(task))


FAILING_SHAPES = {"crash": crashing_agent, "hang": hanging_agent, "no_reward": silent_agent}
SHAPES = {
    "tools": tool_agent,
    "streaming": streaming_agent,
    "retry": retrying_agent,
    "sub_agent": sub_agent,
    "compacted": compacting_agent,
    "crossed_key": crossing_agent,
    "agents_sdk": solve,
}


async def any_shape(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """The agent of the task's ``shape`` (a key of :data:`SHAPES`)."""
    KEYS_SEEN.setdefault(client.api_key, str(client.base_url))
    return await (SHAPES | FAILING_SHAPES)[task["shape"]](client, task)


class BrokenAgent(Agent):
    """An agent class of a user's own whose episode has a bug (a KeyError), loaded by import path."""

    name = "broken_agent"

    async def episode(self, door: AgentDoor, task: dict[str, Any]) -> AgentResult:
        return AgentResult(reward=task["no_such_key"])
