"""Environments: multi-turn episodes with verifiable rewards (protocol in :mod:`tasks.environments.base`).

Built-ins: ``arithmetic``, ``guess_number``, ``calculator``; prompt files (``.parquet`` /
``.jsonl`` / ``.json``); user classes by ``package.module:ClassName``. See docs/environments.md.
"""

from tasks.environments.base import Environment, Message, Turn, check_messages
from tasks.environments.registry import BUILTIN_ENVIRONMENTS, environment_class, load_environment
from tasks.environments.rewards import REWARD_FUNCTIONS, Score, reward_function
from tasks.errors import EnvironmentLoadError

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "REWARD_FUNCTIONS",
    "Environment",
    "EnvironmentLoadError",
    "Message",
    "Score",
    "Turn",
    "check_messages",
    "environment_class",
    "load_environment",
    "reward_function",
]
