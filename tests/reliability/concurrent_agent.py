"""A command agent for the crash trials: two sub-agents at once, three model calls each, whatever the model says.

It knows nothing of rollout-ledger: it reads ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and its task
(``{"a": int, "b": int}`` in ``ROLLOUT_LEDGER_TASK``), runs two sub-agents concurrently on the
official ``openai`` client (``asyncio.gather``: which one's call reaches the gateway first is up to
the event loop and the server), each extending its own conversation, and prints its reward as JSON
on its last line, naming the scored reply by its id. It is deterministic given the model's replies,
so a resumed run asks exactly what the killed one asked, in whatever order.
"""

import asyncio
import json
import os

import openai

task = json.loads(os.environ["ROLLOUT_LEDGER_TASK"])


async def sub_agent(client: openai.AsyncOpenAI, name: str, opening: str) -> tuple[str, str]:
    """(its last reply's text, that reply's id)."""
    messages = [{"role": "system", "content": f"You are {name}."}, {"role": "user", "content": opening}]
    text, response_id = "", ""
    for follow_up in ("Check it.", "So what is the number?", None):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text, response_id = reply.choices[0].message.content or "", reply.id
        messages.append({"role": "assistant", "content": text})
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
    return text, response_id


async def main() -> tuple[str, str]:
    async with openai.AsyncOpenAI() as client:
        adder, _ = await asyncio.gather(
            sub_agent(client, "the adder", f"What is {task['a']} + {task['b']}?"),
            sub_agent(client, "the multiplier", f"What is {task['a']} * {task['b']}?"),
        )
    return adder


text, response_id = asyncio.run(main())
# With two chains the last call is no witness of the scored one: name it (its id) with the text.
print(
    json.dumps({"reward": float(str(task["a"] + task["b"]) in text), "final_output": text, "response_id": response_id})
)
