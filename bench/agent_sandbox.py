"""The agent sandbox's start-up cost: one agent command per episode, sandboxed (bubblewrap) vs a plain process.

Each episode is :meth:`AgentCommand.run` end to end as generate runs it: the fresh home, the
launcher (rlimits, ``PR_SET_PDEATHSIG``), for ``isolation: sandbox`` ``bwrap`` and its
namespaces and binds, the command, its output read back, the process group killed. Two commands:
``echo`` (a shell printing the reward: the floor, where the sandbox is most of the cost) and
``python`` (the worker's interpreter printing the reward: what a Python agent pays at least).
Runs alternate between the isolations, ``--rounds`` rounds of ``--episodes`` sequential episodes
each after one warm-up round; per round the median episode time of each isolation, and the
median over rounds of sandbox ÷ process, is printed with the extra milliseconds per process.

    python bench/agent_sandbox.py [--rounds 7] [--episodes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.environments.agent_sandbox import ISOLATIONS, check_sandbox
from tasks.environments.agents import AgentCommand, AgentDoor

COMMANDS = {
    "echo": ["/bin/sh", "-c", "echo '{\"reward\": 1}'"],
    "python": ["{python}", "-c", "print('{\"reward\": 1}')"],
}
DOOR = AgentDoor("http://127.0.0.1:9/rollouts/r/v1", "bench-key-0123456789")


def episode_seconds(agent: AgentCommand, episodes: int) -> list[float]:
    """Seconds of each of ``episodes`` sequential episodes of ``agent``."""

    async def run() -> list[float]:
        times = []
        for index in range(episodes):
            started = time.perf_counter()
            result = await agent.run(DOOR, {"i": index})
            times.append(time.perf_counter() - started)
            assert result.reward == 1
        return times

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--episodes", type=int, default=20)
    args = parser.parse_args()
    check_sandbox()
    with tempfile.TemporaryDirectory() as folder:
        tasks = Path(folder) / "tasks.jsonl"
        tasks.write_text('{"i": 0}\n')
        for name, command in COMMANDS.items():
            agents = {
                isolation: AgentCommand(command=command, tasks=str(tasks), isolation=isolation)
                for isolation in ISOLATIONS
            }
            try:
                for agent in agents.values():  # warm-up: imports, page cache
                    episode_seconds(agent, 3)
                medians: dict[str, list[float]] = {isolation: [] for isolation in ISOLATIONS}
                ratios = []
                for round_index in range(args.rounds):
                    order = ISOLATIONS if round_index % 2 == 0 else tuple(reversed(ISOLATIONS))
                    for isolation in order:
                        medians[isolation].append(statistics.median(episode_seconds(agents[isolation], args.episodes)))
                    ratios.append(medians["sandbox"][-1] / medians["process"][-1])
            finally:
                for agent in agents.values():
                    agent.close()
            sandbox, process = (statistics.median(medians[i]) * 1000 for i in ("sandbox", "process"))
            ratio = statistics.median(ratios)
            print(
                f"{name:>6}: per agent process, median of {args.rounds} rounds x {args.episodes} episodes: "
                f"sandbox {sandbox:.1f} ms, process {process:.1f} ms; sandbox / process {ratio:.2f} "
                f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); +{sandbox - process:.1f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
