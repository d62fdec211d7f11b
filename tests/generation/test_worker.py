"""The generate worker an Airflow task starts: only what a trigger may name, the CLI's exit codes and lines."""

from __future__ import annotations

import io
import json
import re

import pytest

from tasks.cli.main import main as cli_main
from tasks.errors import EXIT_OK, EXIT_USAGE
from tasks.generate.worker import main as worker_main


def test_the_worker_refuses_an_environment_only_the_operator_may_run_before_any_engine(tmp_path, capsys):
    root = str(tmp_path / "runs")
    sizes = ["--num-tasks", "1", "--group-size", "1", "--shards", "1"]
    command = ["--environment", "agent_command", "--env-option", 'command=["true"]']
    tasks = ["--env-option", "tasks=examples/arithmetic_tasks.jsonl"]
    planned = cli_main(["plan", "--root", root, "--batch-id", "b-operator", *sizes, *command, *tasks])
    assert planned == EXIT_OK, capsys.readouterr().err
    capsys.readouterr()

    code = worker_main(["--root", root, "--batch-id", "b-operator", "--shard", "0", "--try-number", "1"])
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE and out == ""
    assert err.splitlines()[-1].startswith("rollout-ledger generate: error: environment 'agent_command'")
    assert "starting the engine" not in err


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"name": "vllm", "options": {"engine_kwargs": {"trust_remote_code": True}}}, r"engine_options\.engine_kwargs"),
        (
            {"name": "vllm_server", "options": {"urls": ["http://127.0.0.1:9"]}},
            r"servers \['http://127.0.0.1:9'\]: not the run's servers connection's \['http://127.0.0.1:8000'\]",
        ),
        ({"name": "vllm_server", "options": {"urls": ["http://127.0.0.1:8000"], "api_key_file": "/k"}}, "api_key_file"),
    ],
)
def test_the_worker_applies_the_trigger_policy_again_to_the_config_on_storage(
    tmp_path, capsys, monkeypatch, engine, message
):
    """A batch config edited on storage (untrusted) into one no trigger could have planned: refused before any
    engine starts."""
    root = tmp_path / "runs"
    sizes = ["--num-tasks", "1", "--group-size", "1", "--shards", "1", "--environment", "guess_number"]
    assert cli_main(["plan", "--root", str(root), "--batch-id", "b-edited", *sizes]) == EXIT_OK
    config = root / "batches" / "b-edited" / "plan" / "batch.json"
    edited = {**json.loads(config.read_text()), "engine": engine}
    config.chmod(0o644)
    config.write_text(json.dumps(edited))
    capsys.readouterr()
    servers = {"servers": ["http://127.0.0.1:8000"], "models": []}
    hand_over = {"storage_options": {}, "environment": {}, "trigger_policy": servers}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(hand_over)))
    code = worker_main(["--root", str(root), "--batch-id", "b-edited", "--shard", "0", "--secrets-on-stdin"])
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE and out == "" and "starting the engine" not in err
    assert re.search(message, err.splitlines()[-1]), err
