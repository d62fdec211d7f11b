"""A multi-turn, tool-using agent that runs as a command (environment ``agent_command``).

It knows nothing of rollout-ledger: it reads the three variables every agent command gets,
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (read by the ``openai`` client itself) and
``ROLLOUT_LEDGER_TASK`` (its task, as JSON), talks to the model with the official ``openai``
client, and prints its reward as a JSON object on the last line of its stdout.

    rollout-ledger plan ... --environment agent_command \\
        --env-option command='["{python}", "examples/command_agent.py"]' \\
        --env-option tasks=examples/arithmetic_tasks.jsonl
"""

import json
import os

import openai

TOOLS = [
    {
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
]


def add(a: int, b: int) -> int:
    return a + b


def main() -> None:
    task = json.loads(os.environ["ROLLOUT_LEDGER_TASK"])
    client = openai.OpenAI()
    messages = [
        {"role": "system", "content": "You are a careful assistant. Use the add tool to add numbers."},
        {"role": "user", "content": f"What is {task['a']} + {task['b']}?"},
    ]
    answer = ""
    for _ in range(4):  # at most 4 model calls
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            try:
                result = str(add(**json.loads(call.function.arguments)))
            except (TypeError, ValueError) as error:  # the model's arguments are its own business
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    reward = 1.0 if str(task["a"] + task["b"]) in answer else 0.0
    print(json.dumps({"reward": reward, "final_output": answer}))


if __name__ == "__main__":
    main()
