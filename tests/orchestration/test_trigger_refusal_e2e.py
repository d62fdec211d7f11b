"""A trigger cannot run code: real ``rollout_batch`` runs whose conf names a command are refused, and nothing runs.

The form's environment field is a choice (built-in games and the registry's names), so Airflow
refuses a conf naming ``agent_command`` or an import path before the run exists; a conf that picks
a registry entry but tries to set its fixed ``command`` passes the form (options are an object)
and is refused by plan, which names the field and the registry file and writes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.environments.declared import registry_file
from tasks.orchestration import local_airflow

from .test_dag_runs_e2e import SMALL, states

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def rollout_batch(airflow_db):
    return local_airflow.dag_bag("rollout_batch.py").dags["rollout_batch"]


@pytest.mark.parametrize("environment", ["agent_command", "tasks.environments.guess_number:GuessNumber"])
def test_a_conf_naming_code_is_refused_before_the_run(rollout_batch, tmp_path, environment):
    planted = tmp_path / "ran"
    conf = {
        **SMALL,
        "environment": environment,
        "environment_options": {"command": ["bash", "-c", f"touch {planted}"], "tasks": str(tmp_path / "t.jsonl")},
        "storage_url": f"file://{tmp_path}/runs",
    }
    with pytest.raises(Exception, match=f"'{environment}' is not one of"):
        rollout_batch.test(run_conf=conf)
    assert not planted.exists() and not (tmp_path / "runs").exists()


def test_a_conf_setting_a_registry_entrys_command_fails_plan_and_writes_nothing(rollout_batch, tmp_path, caplog):
    planted = tmp_path / "ran"
    conf = {
        **SMALL,
        "environment": "command_agent_example",
        "environment_options": {"command": ["bash", "-c", f"touch {planted}"]},
        "storage_url": f"file://{tmp_path}/runs",
    }
    dag_run = rollout_batch.test(run_conf=conf)
    assert str(dag_run.state) == "failed"
    assert states(dag_run)["plan"] == "failed" and states(dag_run)["generate"] == "upstream_failed"
    assert not planted.exists()
    assert not list(Path(tmp_path / "runs").rglob("*.json")), "plan wrote part of the batch"
    refusal = f"environment_options.command: environment 'command_agent_example' is declared in {registry_file()}"
    assert refusal in caplog.text
