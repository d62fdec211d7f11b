"""A command agent for the crash trials: three model calls in one conversation, whatever the model says.

It knows nothing of rollout-ledger: it reads ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and its task
(``{"a": int, "b": int}`` in ``ROLLOUT_LEDGER_TASK``) from its environment, talks to the model with
the official ``openai`` client, and prints its reward as JSON on its last line. Each call extends
the one before (the gateway splices it onto that call's exact tokens); it is deterministic given
the model's replies, so a resumed run asks exactly what the killed one asked.
"""

import json
import os

import openai

task = json.loads(os.environ["ROLLOUT_LEDGER_TASK"])
client = openai.OpenAI()
messages = [{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]
text = ""
for follow_up in ("Check your answer step by step.", "So what is the final number?", None):
    reply = client.chat.completions.create(model="policy", messages=messages)
    text = reply.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": text})
    if follow_up is not None:
        messages.append({"role": "user", "content": follow_up})
print(json.dumps({"reward": float(str(task["a"] + task["b"]) in text), "final_output": text}))
