"""The generate worker an Airflow task starts: only what a trigger may name, the CLI's exit codes and lines."""

from __future__ import annotations

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
