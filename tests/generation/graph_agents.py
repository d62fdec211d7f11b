"""Agents whose requests change what the message graph compares beyond messages (loaded by import path)."""

from __future__ import annotations

import json
from typing import Any

from .agents_for_tests import ADD_TOOL, as_history, question, scored

MUL_TOOL = {
    "type": "function",
    "function": {
        "name": "mul",
        "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


async def tools_changing_agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Offers ``add``; sends the tool's result back offering ``add`` and ``mul``; then asks for the answer
    with ``tool_choice: "none"`` (no tools offered). Each request extends the one before."""
    messages = question(task)
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
    message = first.choices[0].message
    (call,) = message.tool_calls
    arguments = json.loads(call.function.arguments)
    messages += [
        as_history(message),
        {"role": "tool", "tool_call_id": call.id, "content": str(sum(arguments.values()))},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL, MUL_TOOL])
    messages += [as_history(second.choices[0].message), {"role": "user", "content": "So?"}]
    final = await client.chat.completions.create(
        model="policy", messages=messages, tools=[ADD_TOOL, MUL_TOOL], tool_choice="none"
    )
    return scored(task, final.choices[0].message.content)
