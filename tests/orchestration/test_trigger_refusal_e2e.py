"""A trigger cannot run code, read a worker's files or send them anywhere: real ``rollout_batch`` runs, refused.

The form's environment field is a choice (built-in games and the registry's names), so Airflow
refuses a conf naming ``agent_command`` or an import path before the run exists; a conf that picks
a registry entry but tries to set its fixed ``command`` passes the form (options are an object)
and is refused by plan, which names the field and the registry file and writes nothing. The
trigger policy (tasks/trigger_policy.py) refuses engine kwargs that load code, server URLs and
key files (the servers come from a connection), and storage outside the deployment's lists.
"""

from __future__ import annotations

import http.server
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException

from tasks.environments.declared import registry_file
from tasks.orchestration import local_airflow, steps
from tasks.orchestration.form import form_defaults

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


def test_engine_kwargs_that_load_code_are_refused_and_the_code_never_runs(rollout_batch, tmp_path):
    """The review's reproduction: engine_kwargs.reasoning_parser_plugin naming a .py file ran it on the worker."""
    planted, plugin = tmp_path / "ran", tmp_path / "plugin.py"
    plugin.write_text(f"open({str(planted)!r}, 'w').close()\n")
    conf = {
        **SMALL,
        "engine_options": {"max_model_len": 2048, "engine_kwargs": {"reasoning_parser_plugin": str(plugin)}},
        "storage_url": f"file://{tmp_path}/runs",
    }
    with pytest.raises(Exception, match="engine_kwargs"):  # the form: an engine option a trigger may not set
        rollout_batch.test(run_conf=conf)
    params = {**form_defaults(), **conf}  # past the form (a conf changed on its way in): the plan step refuses it
    with pytest.raises(AirflowFailException, match=r"engine_options\.engine_kwargs: a trigger may not set it"):
        steps.plan(params, SimpleNamespace(dag_id="rollout_batch", run_id="past-the-form"))
    assert not planted.exists() and not (tmp_path / "runs").exists(), "the plugin ran, or plan touched the storage"


@pytest.fixture
def listener():
    """A loopback HTTP server that records every request it gets (an attacker's, or an internal service)."""
    seen: list[tuple[str, dict]] = []

    class Record(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, dict(self.headers)))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"data": [{"id": "internal-secret-answer"}]}')

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Record)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


def test_a_conf_naming_servers_or_a_key_file_sends_nothing_anywhere(rollout_batch, tmp_path, caplog, listener):
    """The review's reproduction: urls naming a listener and api_key_file naming a worker file sent the file's
    content as a bearer token (and plan's GETs echoed the answer into the log)."""
    url, seen = listener
    secret = tmp_path / "worker-secret"
    secret.write_text("planted-worker-file-secret")
    base = {**SMALL, "engine": "vllm_server", "storage_url": f"file://{tmp_path}/runs"}
    attempts = [
        {"engine_options": {"urls": [url], "api_key_file": str(secret)}},
        {"engine_options": {"urls": [url]}},
        {"engine_options": {}},  # no connection named: there are no servers a trigger could reach
    ]
    for extra in attempts:
        refusal = refused_or_failed_plan(rollout_batch, {**base, **extra}, caplog)
        assert re.search("urls|api_key_file|engine_conn_id", refusal) and "planted-worker-file-secret" not in refusal
    assert seen == [] and "internal-secret-answer" not in caplog.text
    assert not (tmp_path / "runs").exists()


def refused_or_failed_plan(dag, conf: dict, caplog) -> str:
    """Why the run of ``conf`` did not happen: the form's refusal, or the log of its failed plan."""
    try:
        dag_run = dag.test(run_conf=conf)
    except Exception as refused:  # Airflow's form check: the run never exists
        return str(refused)
    assert states(dag_run)["plan"] == "failed"
    return caplog.text


@pytest.mark.parametrize(
    ("storage", "message"),
    [
        ({"storage_url": "file:///etc/rollout-ledger"}, "storage_url"),
        ({"storage_url": "s3://someone-elses-bucket/runs"}, "storage_url"),
        ({"storage_conn_id": "aws_default"}, "storage_conn_id"),
    ],
)
def test_storage_outside_the_deployments_lists_is_refused_before_the_run(rollout_batch, storage, message):
    with pytest.raises(Exception, match=message):
        rollout_batch.test(run_conf={**SMALL, "storage_url": "file:///tmp/rollout-ledger-refused/runs", **storage})
    assert not Path("/etc/rollout-ledger").exists() and not Path("/tmp/rollout-ledger-refused").exists()
