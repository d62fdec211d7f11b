"""Periodic profiles: the shipped file loads, each bad field is named, and a broken file breaks only its own DAGs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tasks.errors import ProfileError
from tasks.orchestration import local_airflow
from tasks.orchestration.profiles import load_profiles

GOOD = """
profiles:
  hourly_small:
    schedule: "15 * * * *"
    timezone: Europe/Paris
    paused: false
    params: {num_tasks: 4, group_size: 2, shards: 1, engine: vllm, reward_max: 1.0}
  defaults_only:
    schedule: "0 0 * * 0"
"""


def write(tmp_path, text: str):
    path = tmp_path / "profiles.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_the_shipped_profile_is_valid_and_paused():
    (profile,) = load_profiles(local_airflow.DAGS_FOLDER / "profiles.yaml")
    assert profile.dag_id == "rollout_batch__nightly_arithmetic" and profile.paused is True
    assert profile.cron == "0 3 * * *" and profile.params["environment"] == "arithmetic"


def test_valid_profiles_with_defaults(tmp_path):
    hourly, weekly = load_profiles(write(tmp_path, GOOD))
    assert (hourly.name, hourly.cron, hourly.timezone, hourly.paused) == (
        "hourly_small",
        "15 * * * *",
        "Europe/Paris",
        False,
    )
    assert hourly.params == {"num_tasks": 4, "group_size": 2, "shards": 1, "engine": "vllm", "reward_max": 1.0}
    assert (weekly.timezone, weekly.paused, weekly.params) == ("UTC", True, {})


def test_an_absent_or_empty_file_has_no_profiles(tmp_path):
    assert load_profiles(tmp_path / "absent.yaml") == []
    assert load_profiles(write(tmp_path, "")) == []


@pytest.mark.parametrize(
    ("profile", "named"),
    [
        ('p:\n    schedule: "0 3 * *"', "schedule '0 3 * *'"),
        ('p:\n    schedule: "0 99 * * *"', "schedule"),
        ('p:\n    schedule: "0 3 * * *"\n    timezone: Mars/Olympus', "timezone 'Mars/Olympus'"),
        ('p:\n    schedule: "0 3 * * *"\n    paused: maybe', "paused must be true or false"),
        ('p:\n    schedule: "0 3 * * *"\n    cron: x', "unknown field(s) ['cron']"),
        ('p:\n    schedule: "0 3 * * *"\n    params: {num_taks: 4}', "params.num_taks is not a batch form field"),
        (
            'p:\n    schedule: "0 3 * * *"\n    params: {num_tasks: 0}',
            "params.num_tasks: 0 is less than the minimum of 1",
        ),
        ('p:\n    schedule: "0 3 * * *"\n    params: {engine: megatronn}', "params.engine: 'megatronn' is not one of"),
        ('p:\n    schedule: "0 3 * * *"\n    params: {batch_id: fixed}', "params.batch_id cannot be set"),
        ('Bad-Name:\n    schedule: "0 3 * * *"', "[a-z0-9_] only"),
    ],
)
def test_a_bad_field_is_named_with_its_profile(tmp_path, profile, named):
    path = write(tmp_path, "profiles:\n  " + profile + "\n")
    with pytest.raises(ProfileError) as error:
        load_profiles(path)
    assert named in str(error.value) and str(path) in str(error.value)


def test_not_yaml_or_the_wrong_shape_is_refused(tmp_path):
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profiles(write(tmp_path, "profiles: [unclosed"))
    with pytest.raises(ProfileError, match="single top-level mapping"):
        load_profiles(write(tmp_path, "nightly: {schedule: '0 3 * * *'}"))


def test_a_broken_profiles_file_is_an_import_error_of_its_dag_file_only(tmp_path):
    """In a fresh process (the DAG processor's view): the other DAG files still load, the error names the field."""
    path = write(tmp_path, 'profiles:\n  nightly:\n    schedule: "0 3 * * *"\n    params: {shards: -1}\n')
    script = (
        "from tasks.orchestration.local_airflow import dag_bag\n"
        "bag = dag_bag()\n"
        "print(sorted(bag.dags)); print(' | '.join(bag.import_errors.values()).replace('\\n', ' '))\n"
    )
    env = {**os.environ, "ROLLOUT_LEDGER_PROFILES": str(path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    dags, errors = out.strip().splitlines()[-2:]
    assert (
        dags
        == "['grpo_dataset_consumer', 'grpo_train', 'policy_refit_batch', 'rollout_batch', 'rollout_batch_on_servers']"
    )
    assert "profile 'nightly': params.shards: -1 is less than the minimum of 1" in errors
