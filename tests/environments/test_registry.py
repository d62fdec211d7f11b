"""load_environment: built-in names, prompt files, and user classes by import path, each failure with its reason."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tasks.environments import BUILTIN_ENVIRONMENTS, load_environment
from tasks.environments.arithmetic import Arithmetic
from tasks.environments.guess_number import GuessNumber
from tasks.environments.prompts_file import PromptsFile
from tasks.environments.registry import environment_class
from tasks.errors import ENVIRONMENT_LOAD_REASONS as LOAD_REASONS
from tasks.errors import EnvironmentLoadError

USER_MODULE = '''
from tasks.environments.base import Environment, Turn


class Echo(Environment):
    """Reward 1.0 when the reply contains the word."""

    name = "echo"

    def __init__(self, *, word: str = "hello") -> None:
        super().__init__()
        if not isinstance(word, str) or not word:
            raise ValueError(f"option word must be a non-empty string, got {word!r}")
        self.word = word

    def options(self):
        return {"word": self.word}

    def make_tasks(self, num_tasks, seed):
        return [{"word": self.word, "index": index} for index in range(num_tasks)]

    def initial_messages(self, task):
        return [{"role": "user", "content": f"Say {task['word']}."}]

    def step(self, task, messages):
        return Turn.finish(float(task["word"] in messages[-1]["content"]))


class NotAnEnvironment:
    pass


class Abstract(Environment):
    pass


NOT_A_CLASS = 3
'''


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A fresh importable package (unique name) holding the user module and two broken ones."""
    package = f"user_envs_{uuid.uuid4().hex[:8]}"
    root = tmp_path / package
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "envs.py").write_text(USER_MODULE)
    (root / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    (root / "needs_dep.py").write_text("import surely_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return package


def reason_of(spec, options=None):
    with pytest.raises(EnvironmentLoadError) as refused:
        load_environment(spec, options)
    assert refused.value.reason in LOAD_REASONS
    assert refused.value.spec == spec
    return refused.value


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVIRONMENTS))
def test_builtins_load_by_name(name, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"question": "2+2"}\n')
    agent_options = {"agent_command": {"command": ["true"]}, "agent_callable": {"function": "asyncio:sleep"}}
    options = {**agent_options[name], "tasks": str(tasks)} if name in agent_options else None
    env = load_environment(name, options)
    assert type(env) is BUILTIN_ENVIRONMENTS[name]
    assert env.name == name


def test_builtin_options_are_passed_and_recorded():
    env = load_environment("guess_number", {"lo": 0, "hi": 7})
    assert isinstance(env, GuessNumber) and env.options() == {"lo": 0, "hi": 7}
    assert load_environment("guess_number", env.options()).make_tasks(5, 1) == env.make_tasks(5, 1)


def test_user_class_loads_by_import_path_with_options(user_package, play):
    env = load_environment(f"{user_package}.envs:Echo", {"word": "banana"})
    assert env.options() == {"word": "banana"}
    _, turn = play(env, env.make_tasks(1, 0)[0], lambda history: "banana!")
    assert turn.reward == 1.0


def test_builtin_classes_load_by_import_path_too():
    assert environment_class("tasks.environments.arithmetic:Arithmetic") is Arithmetic


def test_prompt_file_spec_loads_prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "q", "ground_truth": "a"}) + "\n")
    assert isinstance(load_environment(str(path)), PromptsFile)
    assert (
        load_environment(str(path), {"path": str(path), "reward": "exact_match"}).options()["path"] == f"file://{path}"
    )


def test_unknown_name_lists_the_builtins():
    error = reason_of("chess")
    assert error.reason == "unknown_environment"
    assert "arithmetic" in str(error) and "pkg.module:Class" in str(error)


@pytest.mark.parametrize("spec", [":Echo", "pkg.module:", "a:b:c"])
def test_malformed_import_path_is_refused(spec):
    assert reason_of(spec).reason == "bad_import_path"


def test_missing_module_is_refused_naming_it(user_package):
    error = reason_of(f"{user_package}.nowhere:Echo")
    assert error.reason == "module_not_found"
    assert f"no module named '{user_package}.nowhere'" in str(error)


def test_a_module_whose_own_import_fails_is_import_failed_not_module_not_found(user_package):
    error = reason_of(f"{user_package}.needs_dep:Echo")
    assert error.reason == "import_failed"
    assert "surely_missing_dependency_xyz" in str(error)
    assert reason_of(f"{user_package}.broken:Echo").reason == "import_failed"


def test_missing_attribute_is_refused_naming_it(user_package):
    error = reason_of(f"{user_package}.envs:Nope")
    assert error.reason == "attribute_missing"
    assert "has no 'Nope'" in str(error)


@pytest.mark.parametrize("attribute", ["NotAnEnvironment", "NOT_A_CLASS", "Abstract", "Turn"])
def test_anything_but_a_concrete_environment_subclass_is_refused(user_package, attribute):
    assert reason_of(f"{user_package}.envs:{attribute}").reason == "not_an_environment"


@pytest.mark.parametrize(
    ("spec", "options", "fragment"),
    [
        ("arithmetic", {"difficulty": 3}, "takes no options"),
        ("guess_number", {"lo": 10, "hi": 1}, "need lo < hi"),
        ("guess_number", {"low": 1}, "unknown option 'low' (did you mean 'lo'?); guess_number accepts: hi, lo"),
        ("USER:Echo", {"word": ""}, "option word must be a non-empty string"),
        ("USER:Echo", {"colour": "red"}, "unknown option 'colour'; echo accepts: word"),
        (
            "tasks.environments.prompts_file:PromptsFile",
            {},
            "missing option 'path'; prompts_file accepts: path, reward",
        ),
    ],
)
def test_bad_options_are_refused_with_the_cause(user_package, spec, options, fragment):
    spec = spec.replace("USER", f"{user_package}.envs")
    error = reason_of(spec, options)
    assert error.reason == "bad_options"
    assert fragment in str(error)


def test_prompt_file_errors_are_bad_prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "q", "ground_truth": "a"}) + "\n")
    assert reason_of(str(tmp_path / "absent.parquet")).reason == "bad_prompt_file"
    assert reason_of(str(path), {"reward": "f1"}).reason == "bad_options"
    assert reason_of(str(path), {"path": str(tmp_path / "other.jsonl")}).reason == "bad_options"


def test_the_minimal_example_in_the_docs_loads_by_import_path(tmp_path, monkeypatch, play):
    docs = (Path(__file__).parents[2] / "docs" / "environments.md").read_text(encoding="utf-8")
    example = docs.split("```python\n# my_envs.py\n", 1)[1].split("```", 1)[0]
    module = f"docs_example_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(example, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment(f"{module}:Echo", {"word": "ok"})
    assert env.options() == {"word": "ok"}
    _, turn = play(env, env.make_tasks(1, seed=0)[0], lambda history: "ok")
    assert turn.reward == 1.0
