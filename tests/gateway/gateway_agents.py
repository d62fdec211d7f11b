"""Agents that misuse the capture gateway, for the attempt-level tests (loaded by import path)."""

from __future__ import annotations

from typing import Any

PROBES = 2  # requests of each probing agent without its route's key
REFUSED = 34  # requests of each probing agent refused on its own route (over the 32 kept)


async def probing_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Calls with a wrong key and on an unknown rollout id (401 both), is refused :data:`REFUSED`
    times on its own route (a temperature other than the plan's), then answers."""
    import openai

    messages = [{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]
    rollout_id = str(client.base_url).rstrip("/").split("/")[-2]
    strangers = [
        client.with_options(api_key="a guess"),
        client.with_options(base_url=str(client.base_url).replace(f"/{rollout_id}/", "/no-such-rollout/")),
    ]
    for stranger in strangers:
        try:
            await stranger.chat.completions.create(model="policy", messages=messages)
        except openai.AuthenticationError:
            continue
        raise AssertionError("a request without its route's key was answered")
    for _ in range(REFUSED):
        try:
            await client.chat.completions.create(model="policy", messages=messages, temperature=0.123)
        except openai.BadRequestError:
            continue
        raise AssertionError("a temperature other than the plan's was answered")
    reply = await client.chat.completions.create(model="policy", messages=messages)
    return {"reward": 1.0, "response_id": reply.id}
