"""Deterministic task generation: task ``i`` of seed ``s`` is a pure function of ``(name, s, i)``.

Each task draws from its own :class:`random.Random` stream seeded with the string
``"{name}:{seed}:{index}"`` (string seeds hash with SHA-512, stable across processes and
Python versions), so a task never depends on ``num_tasks`` or on the tasks before it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any


def task_rng(name: str, seed: int, index: int) -> random.Random:
    """The independent random stream of task ``index`` of environment ``name`` under ``seed``."""
    return random.Random(f"{name}:{seed}:{index}")


def check_task_request(num_tasks: object, seed: object, *, env: str) -> None:
    """Refuse a ``num_tasks`` that is not an int >= 0 or a ``seed`` that is not an int."""
    if not isinstance(num_tasks, int) or isinstance(num_tasks, bool) or num_tasks < 0:
        raise ValueError(f"environment {env!r}: num_tasks must be an int >= 0, got {num_tasks!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"environment {env!r}: seed must be an int, got {seed!r}")


def generate_tasks(
    name: str, num_tasks: int, seed: int, build: Callable[[random.Random], dict[str, Any]]
) -> list[dict[str, Any]]:
    """``num_tasks`` tasks, task ``i`` built from :func:`task_rng` ``(name, seed, i)``."""
    check_task_request(num_tasks, seed, env=name)
    return [build(task_rng(name, seed, index)) for index in range(num_tasks)]
