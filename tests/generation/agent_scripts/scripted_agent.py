"""A command agent for the tests: what it does is the task's ``behavior`` (answer, crash, hang, no_reward).

It knows nothing of rollout-ledger: it reads ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and the task
(JSON in ``ROLLOUT_LEDGER_TASK``) from its environment, as any agent command does.
"""

import json
import os
import sys
import time

import openai

task = json.loads(os.environ["ROLLOUT_LEDGER_TASK"])
behavior = task.get("behavior", "answer")
client = openai.OpenAI()  # the base URL and key come from the environment
reply = client.chat.completions.create(
    model="policy", messages=[{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]
)
text = reply.choices[0].message.content or ""
print(f"the model said: {text!r}")
if behavior == "crash":
    print("the agent's tool crashed", file=sys.stderr)
    sys.exit(3)
if behavior == "hang":
    time.sleep(600)
if behavior == "no_reward":
    print("done, without a reward")
    sys.exit(0)
print(json.dumps({"reward": float(str(task["a"] + task["b"]) in text), "final_output": text}))
