"""Agents that meet the gateway's faults, for ``test_agent_faults.py`` (loaded by import path).

Real agents on the official ``openai`` client: one whose client times out and retries while its
episode returns, one whose first connection drops once its call was admitted, ones whose request
the chat template or the tokenizer refuses. What each saw is kept in :data:`SEEN` (by task
``a``) for the test to compare with the ledger.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai

from .agents_for_tests import as_history, question

SLOW = "Answer slowly."  # a request the tests' engine takes its time over
UNENCODABLE = "UNENCODABLE"  # text the tests' tokenizer fails on
SEEN: dict[int, dict[str, Any]] = {}
ADMITTED: list[str] = []  # request ids of the slow calls the tests' engine has begun


async def late_call_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Asks, then asks slowly with a client that times out and retries; returns as soon as that client gives
    up, naming its first answer as the scored one. The slow call is still running then."""
    messages = question(task)
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [as_history(first.choices[0].message), {"role": "user", "content": SLOW}]
    impatient = client.with_options(timeout=0.3, max_retries=2)
    try:
        await impatient.chat.completions.create(model="policy", messages=messages)
        SEEN[task["a"]] = {"timed_out": False}
    except openai.APITimeoutError:
        SEEN[task["a"]] = {"timed_out": True}
    return {"reward": 1.0, "response_id": first.id}


class DroppingTransport(httpx.AsyncHTTPTransport):
    """Drops the first request's connection once the engine has begun its call; later tries go through."""

    def __init__(self) -> None:
        super().__init__()
        self.tries = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.tries += 1
        if self.tries > 1:
            return await super().handle_async_request(request)
        begun = len(ADMITTED)
        sent = asyncio.create_task(super().handle_async_request(request))
        async with asyncio.timeout(30):
            while len(ADMITTED) == begun:
                await asyncio.sleep(0.01)
        sent.cancel()  # the connection closes with the answer unread
        await asyncio.gather(sent, return_exceptions=True)
        raise httpx.ReadError("the connection dropped")


async def dropped_connection_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Asks slowly on a connection that drops after its call was admitted; the client's default retries
    get the answer."""
    transport = DroppingTransport()
    async with httpx.AsyncClient(transport=transport) as http:
        dropping = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, http_client=http)
        messages = [*question(task)[:-1], {"role": "user", "content": f"{question(task)[-1]['content']} {SLOW}"}]
        reply = await dropping.chat.completions.create(model="policy", messages=messages)
    SEEN[task["a"]] = {"tries": transport.tries, "id": reply.id}
    return {"reward": 1.0, "response_id": reply.id}


async def refused_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Sends one request the gateway fails (two user turns in a row for a template that forbids them, or text
    the tokenizer cannot encode, by the task's ``fault``) with the client's default retries."""
    messages = question(task)
    if task["fault"] == "template":
        messages.append({"role": "user", "content": "And twice that?"})
    else:
        messages[-1]["content"] += f" {UNENCODABLE}"
    try:
        await client.chat.completions.create(model="policy", messages=messages)
    except openai.APIStatusError as error:
        SEEN[task["a"]] = {"status": error.status_code, "code": error.code}
    return {"reward": 0.0}


async def by_shape(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """The agent the task's ``shape`` names: ``late_call`` or ``dropped_connection``."""
    shapes = {"late_call": late_call_agent, "dropped_connection": dropped_connection_agent}
    return await shapes[task["shape"]](client, task)
