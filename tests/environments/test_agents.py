"""Agent environments' options, task files and rewards (their episodes: tests/generation/test_agent_rollouts.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

import pytest

from tasks.environments.agent_process import AgentLimits
from tasks.environments.agents import AgentCommand, AgentDoor, AgentFailure, result_of
from tasks.environments.registry import load_environment
from tasks.errors import EnvironmentLoadError


@pytest.fixture
def tasks_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(10)) + "\n")
    return path


def test_options_are_recorded_with_the_task_file_pinned(tasks_file):
    agent = load_environment("agent_command", {"command": ["true"], "tasks": str(tasks_file)})
    digest = hashlib.sha256(tasks_file.read_bytes()).hexdigest()
    assert agent.options() == {
        "command": ["true"],
        "scorer": None,
        "env": [],
        "limits": AgentLimits().as_options(),
        "isolation": "sandbox",
        "binds": [],
        "tasks": f"file://{tasks_file}",
        "sha256": digest,
        "timeout_s": 600.0,
        "max_concurrency": None,
    }
    assert load_environment("agent_command", agent.options()).options() == agent.options()


def test_tasks_are_a_seeded_prefix_stable_sample_of_the_file(tasks_file):
    agent = load_environment("agent_command", {"command": ["true"], "tasks": str(tasks_file)})
    assert agent.make_tasks(4, seed=3) == agent.make_tasks(10, seed=3)[:4]
    assert sorted(t["i"] for t in agent.make_tasks(10, seed=3)) == list(range(10))
    assert agent.make_tasks(10, seed=3) != agent.make_tasks(10, seed=4)
    with pytest.raises(ValueError, match="has 10 rows, 11 tasks asked"):
        agent.make_tasks(11, seed=3)


@pytest.mark.parametrize(
    ("options", "reason", "needle"),
    [
        ({"command": "python agent.py"}, "bad_options", "command must be a non-empty list"),
        ({"command": []}, "bad_options", "command must be a non-empty list"),
        ({"command": ["true"], "timeout_s": 0}, "bad_options", "timeout_s must be a positive number"),
        ({"command": ["true"], "max_concurrency": 1.5}, "bad_options", "max_concurrency must be a positive integer"),
        ({"command": ["true"], "scorer": "no_such_module:f"}, "bad_options", "no module named 'no_such_module'"),
        ({"command": ["true"], "sha256": "0" * 64}, "bad_task_file", "changed: sha256 is"),
        ({"command": ["true"], "unknown": 1}, "bad_options", "unknown"),
    ],
)
def test_bad_options_are_refused_naming_what_is_wrong(tasks_file, options, reason, needle):
    with pytest.raises(EnvironmentLoadError, match=needle) as refused:
        load_environment("agent_command", {"tasks": str(tasks_file), **options})
    assert refused.value.reason == reason


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "does not exist"),
        ('{"i": 1}\nnot json\n', "line 2: invalid JSON"),
        ("[1, 2]\n", "line 1: a task must be a JSON object"),
        ("\n\n", "holds no tasks"),
    ],
)
def test_bad_task_files_are_refused_naming_the_file_and_line(tmp_path, content, needle):
    path = tmp_path / "tasks.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(EnvironmentLoadError, match=needle) as refused:
        load_environment("agent_callable", {"function": "asyncio:sleep", "tasks": str(path)})
    assert refused.value.reason == "bad_task_file" and str(path) in str(refused.value)


def test_a_callable_must_be_an_async_function(tasks_file):
    with pytest.raises(EnvironmentLoadError, match="must be an async function"):
        load_environment("agent_callable", {"function": "json:dumps", "tasks": str(tasks_file)})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, (1.0, {}, None, None)),
        ({"reward": 0.5, "steps": 3}, (0.5, {"steps": 3}, None, None)),
        ({"reward": 1, "response_id": "chatcmpl-x", "final_output": "7"}, (1.0, {}, "chatcmpl-x", "7")),
    ],
)
def test_rewards_read_as_numbers_or_objects_with_their_witnesses(value, expected):
    result = result_of(value, source="test")
    assert (result.reward, result.info, result.response_id, result.final_output) == expected


@pytest.mark.parametrize(
    "value", [None, "1", True, float("nan"), {"score": 1}, {"reward": 1, "response_id": ""}, {"reward": [1]}]
)
def test_anything_else_is_no_reward(value):
    with pytest.raises(AgentFailure) as failed:
        result_of(value, source="test")
    assert failed.value.reason == "agent_no_reward"


def test_a_command_that_cannot_start_is_an_agent_error(tasks_file, tmp_path):
    agent = AgentCommand(command=[str(tmp_path / "missing-binary")], tasks=str(tasks_file))
    with pytest.raises(AgentFailure) as failed:
        asyncio.run(agent.run(AgentDoor("http://127.0.0.1:9/v1", "key"), {"i": 0}))
    assert failed.value.reason == "agent_error" and "could not start" in failed.value.detail


def test_a_timed_out_command_is_killed_with_its_children(tasks_file, tmp_path):
    marker = tmp_path / "child-alive"
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    script = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    agent = AgentCommand(command=[sys.executable, "-c", script], tasks=str(tasks_file), timeout_s=1)
    with pytest.raises(AgentFailure) as failed:
        asyncio.run(agent.run(AgentDoor("http://127.0.0.1:9/v1", "key"), {"i": 0}))
    assert failed.value.reason == "agent_timeout"
    asyncio.run(asyncio.sleep(3.5))
    assert not marker.exists(), "the agent's child outlived the time-out"
