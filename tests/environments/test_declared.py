"""The deployment's environment registry: what a triggered batch may run, and what the operator's CLI may."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tasks.batch import Batch
from tasks.environments.agents import AgentCommand
from tasks.environments.declared import REGISTRY_VARIABLE, load_registry, registry_file
from tasks.environments.guess_number import GuessNumber
from tasks.environments.registry import Runnables, load_environment
from tasks.errors import ConfigError
from tasks.orchestration.form import form_fields
from tasks.orchestration.profiles import ProfileError, check_params
from tasks.plan import plan_from_values

TASKS = [{"question": "1 + 1", "answer": 2}, {"question": "2 + 3", "answer": 5}]


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    (tmp_path / "agent.py").write_text("print('{\"reward\": 1}')\n")
    path = tmp_path / "environments.yaml"
    path.write_text(
        """
environments:
  tiny_agent:
    description: a command agent
    kind: agent_command
    options: {command: ["{python}", "{here}/agent.py"], tasks: tasks.jsonl, timeout_s: 30}
    trigger_options:
      timeout_s: {type: number, minimum: 1, maximum: 60}
      max_concurrency: {type: integer, minimum: 1, maximum: 8}
    env: [TOOL_TOKEN]
    binds: ["{here}", data, {path: /srv/scratch, writable: true}]
  plain_agent:
    kind: agent_command
    options: {command: ["{python}", "{here}/agent.py"], tasks: tasks.jsonl}
    isolation: process
  wide_guess:
    kind: guess_number
    options: {lo: 1, hi: 1000}
"""
    )
    return path


def test_an_entry_resolves_its_placeholders_and_relative_paths(registry):
    agent = load_environment("tiny_agent", {"timeout_s": 5}, runnables=Runnables.triggered(registry))
    assert isinstance(agent, AgentCommand)
    assert agent.command == ["{python}", str(registry.parent / "agent.py")]  # {python}: the worker's, at launch
    assert agent.argv == [sys.executable, str(registry.parent / "agent.py")]
    assert agent.tasks_path == f"file://{registry.parent / 'tasks.jsonl'}" and agent.timeout_s == 5
    assert agent.options()["env"] == ["TOOL_TOKEN"]
    here = str(registry.parent.resolve())
    binds = [here, f"{here}/data", {"path": "/srv/scratch", "writable": True}]
    assert agent.options()["binds"] == binds and agent.options()["isolation"] == "sandbox"
    plain = load_environment("plain_agent", {}, runnables=Runnables.triggered(registry))
    assert plain.options()["isolation"] == "process" and plain.options()["binds"] == []
    guess = load_environment("wide_guess", {}, runnables=Runnables.triggered(registry))
    assert isinstance(guess, GuessNumber) and guess.options() == {"lo": 1, "hi": 1000}


@pytest.mark.parametrize(
    "spec",
    ["agent_command", "agent_callable", "tasks.environments.guess_number:GuessNumber", "/tmp/prompts.jsonl", "nope"],
)
def test_a_trigger_cannot_name_code_or_files_directly(registry, spec):
    with pytest.raises(ConfigError, match=f"environment '{spec}'.*{registry}") as caught:
        load_environment(spec, {"command": ["bash", "-c", "true"]}, runnables=Runnables.triggered(registry))
    assert "choices: arithmetic, calculator, guess_number, plain_agent, tiny_agent, wide_guess" in str(caught.value)


def test_the_operator_may_name_code_directly(registry, tmp_path):
    command = load_environment(
        "agent_command",
        {"command": ["true"], "tasks": str(tmp_path / "tasks.jsonl")},
        runnables=Runnables.operator(registry),
    )
    assert command.command == ["true"]
    assert load_environment("tiny_agent", {}, runnables=Runnables.operator(registry)).timeout_s == 30


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"command": ["bash", "-c", "touch x"]}, r"environment_options.command: .* fixes \['command'\]"),
        ({"env": ["AWS_SECRET_ACCESS_KEY"]}, r"environment_options.env: .* fixes \['env'\]"),
        ({"isolation": "process"}, r"environment_options.isolation: .* fixes \['isolation'\]"),
        ({"binds": ["/root"]}, r"environment_options.binds: .* fixes \['binds'\]"),
        ({"timeout_s": 61}, r"environment_options.timeout_s must be a finite number in \[1, 60\], got 61"),
        ({"timeout_s": True}, r"environment_options.timeout_s must be a finite number"),
        ({"max_concurrency": 2.0}, r"environment_options.max_concurrency must be an integer in \[1, 8\]"),
    ],
)
def test_a_trigger_sets_only_open_options_within_their_bounds(registry, options, message):
    with pytest.raises(ConfigError, match=message):
        load_environment("tiny_agent", options, runnables=Runnables.triggered(registry))


def test_recorded_options_must_still_be_what_the_entry_gives(registry):
    runnables = Runnables.triggered(registry)
    recorded = load_environment("tiny_agent", {"max_concurrency": 2}, runnables=runnables).options()
    assert load_environment("tiny_agent", recorded, runnables=runnables).options() == recorded
    tampered = {**recorded, "command": ["bash", "-c", "curl evil"]}  # storage is not trusted
    with pytest.raises(ConfigError, match=r"fixes \['command'\]"):
        load_environment("tiny_agent", tampered, runnables=runnables)
    registry.write_text(registry.read_text().replace("{here}/agent.py", "{here}/other.py"))
    with pytest.raises(ConfigError, match=r"fixes \['command'\].*plan it again"):
        load_environment("tiny_agent", recorded, runnables=Runnables.triggered(registry))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("environments: {x.jsonl: {kind: arithmetic}}", "reads as a prompt file"),
        ("environments: {'../up': {kind: arithmetic}}", "must match"),
        ("environments: {a: {kind: arithmetic, run: x}}", "entry 'a': run: Extra inputs"),
        ("environments: {a: {kind: arithmetic, env: [X]}}", r"\['env'\] are for agent_command entries"),
        ("environments: {a: {kind: arithmetic, isolation: process}}", r"\['isolation'\] are for agent_command"),
        ("environments: {a: {kind: agent_command, isolation: none}}", "isolation: Input should be 'sandbox'"),
        ("environments: {a: {kind: agent_command, binds: [{path: /x, mode: rw}]}}", "binds"),
        ("environments: {a: {kind: agent_command, env: ['A B']}}", "'A B' is not an environment variable name"),
        ("environments: [a]", "a mapping with one key 'environments'"),
        ("profiles: {}", "a mapping with one key 'environments'"),
        (
            "environments: {a: {kind: arithmetic, trigger_options: {n: {type: int}}}}",
            "trigger_options.n.type: Input should be",
        ),
    ],
)
def test_a_bad_registry_is_named_with_its_file_and_entry(tmp_path, text, message):
    path = tmp_path / "environments.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"environment registry {path}.*{message}"):
        load_registry(path)


def test_a_registry_entry_cannot_take_a_built_in_name(tmp_path):
    path = tmp_path / "environments.yaml"
    path.write_text("environments: {agent_command: {kind: arithmetic}}")
    with pytest.raises(ConfigError, match=r"entry name\(s\) \['agent_command'\] are built-ins"):
        Runnables.triggered(path)


def test_the_registry_file_follows_its_variable_and_an_absent_file_declares_nothing(tmp_path):
    assert registry_file({}).name == "environments.yaml" and registry_file({}).parent.name == "dags"
    assert registry_file({REGISTRY_VARIABLE: str(tmp_path / "r.yaml")}) == tmp_path / "r.yaml"
    assert load_registry(tmp_path / "r.yaml").entries == {}
    assert Runnables.triggered(tmp_path / "r.yaml").choices() == ["arithmetic", "calculator", "guess_number"]


def test_the_form_offers_the_built_in_games_and_the_registry_names(registry):
    field = form_fields({REGISTRY_VARIABLE: str(registry)})["environment"]
    assert field["enum"] == ["arithmetic", "calculator", "guess_number", "plain_agent", "tiny_agent", "wide_guess"]
    assert field["values_display"]["tiny_agent"] == "tiny_agent: a command agent" and "examples" not in field


def test_a_profile_cannot_name_a_command(registry, monkeypatch):
    monkeypatch.setenv(REGISTRY_VARIABLE, str(registry))
    with pytest.raises(ProfileError, match=r"params\.environment: 'agent_command' is not one of"):
        check_params("profile p", {"environment": "agent_command"})
    assert check_params("profile p", {"environment": "tiny_agent"}) == {"environment": "tiny_agent"}


def test_plan_refuses_a_triggered_command_before_writing_anything(registry, tmp_path):
    batch = Batch.open(f"file://{tmp_path}/runs", "b1")
    values = {"environment": "agent_command", "environment_options": {"command": ["bash", "-c", "touch x"]}}
    with pytest.raises(ConfigError, match=f"environment 'agent_command'.*{registry}"):
        plan_from_values(batch, values, source="batch form", runnables=Runnables.triggered(registry))
    assert not (tmp_path / "runs").exists()
