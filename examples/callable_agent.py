"""A tool-using agent on the OpenAI Agents SDK, run as a function (environment ``agent_callable``).

rollout-ledger awaits ``solve(client, task)`` once per rollout, with an ``openai.AsyncOpenAI``
client pointed at the rollout's route of the capture gateway. Here the client drives the SDK's
chat-completions model (``pip install openai-agents``). The module must be importable where
generate runs (here: from the repository root, with ``PYTHONPATH=.``).

    rollout-ledger plan ... --environment agent_callable \\
        --env-option function=examples.callable_agent:solve \\
        --env-option tasks=examples/arithmetic_tasks.jsonl
"""

from typing import Any

from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

set_tracing_disabled(True)  # the SDK would otherwise send its traces to OpenAI


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def solve(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Run the agent on the task's question; reward 1 when its final answer holds the sum."""
    agent = Agent(
        name="adder",
        instructions="You are a careful assistant. Use the add tool to add numbers.",
        tools=[add],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )
    try:
        result = await Runner.run(agent, f"What is {task['a']} + {task['b']}?", max_turns=4)
    except MaxTurnsExceeded:
        return {"reward": 0.0}  # still calling tools after 4 turns: no answer
    answer = str(result.final_output)
    return {"reward": 1.0 if str(task["a"] + task["b"]) in answer else 0.0, "final_output": answer}
