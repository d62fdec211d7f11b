"""Generated tasks are a pure function of the seed: reproducible, seed-sensitive, prefix-stable, JSON-able."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.environments import BUILTIN_ENVIRONMENTS, load_environment
from tasks.environments.base import Environment
from tasks.environments.seeding import check_task_request

# The games generate their tasks; agents read theirs from a task file (tests/environments/test_agents.py).
BUILTINS = sorted(name for name, cls in BUILTIN_ENVIRONMENTS.items() if issubclass(cls, Environment))


@pytest.mark.parametrize("name", BUILTINS)
def test_same_seed_gives_the_same_tasks_across_instances(name):
    assert load_environment(name).make_tasks(20, seed=7) == load_environment(name).make_tasks(20, seed=7)


@pytest.mark.parametrize("name", BUILTINS)
def test_different_seeds_give_different_tasks(name):
    env = load_environment(name)
    assert env.make_tasks(20, seed=7) != env.make_tasks(20, seed=8)


@pytest.mark.parametrize("name", BUILTINS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(min_value=-(2**63), max_value=2**63), num_tasks=st.integers(min_value=0, max_value=30))
def test_task_i_does_not_depend_on_num_tasks(name, seed, num_tasks):
    env = load_environment(name)
    assert env.make_tasks(num_tasks, seed) == env.make_tasks(30, seed)[:num_tasks]


@pytest.mark.parametrize("name", BUILTINS)
def test_tasks_round_trip_through_json(name):
    tasks = load_environment(name).make_tasks(10, seed=0)
    assert json.loads(json.dumps(tasks)) == tasks


@pytest.mark.parametrize(
    ("num_tasks", "seed", "field"), [(-1, 0, "num_tasks"), (True, 0, "num_tasks"), (2, "0", "seed")]
)
def test_bad_task_requests_are_refused_naming_the_field(num_tasks, seed, field):
    with pytest.raises(ValueError, match=rf"'arithmetic': {field} must be"):
        check_task_request(num_tasks, seed, env="arithmetic")
