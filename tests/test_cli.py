"""The ``rollout-ledger`` command line: exit codes, and plan + generate on defaults end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tasks.cli import EXIT_FAILED, EXIT_USAGE, main
from tasks.plan import batch_store
from tasks.storage.ledger_reader import LedgerReader


def plan_args(root: str, batch_id: str = "b-cli", *extra: str) -> list[str]:
    return [
        "plan",
        "--root",
        root,
        "--batch-id",
        batch_id,
        "--environment",
        "guess_number",
        "--num-tasks",
        "2",
        "--group-size",
        "2",
        "--shards",
        "1",
        "--max-turns",
        "2",
        "--max-tokens",
        "16",
        *extra,
    ]


def test_usage_errors_exit_2(tmp_path, capsys):
    root = str(tmp_path)
    with pytest.raises(SystemExit) as caught:
        main(["plan", "--root", root])
    assert caught.value.code == EXIT_USAGE
    assert main(plan_args(root, "../escape")) == EXIT_USAGE
    assert "batch_id" in capsys.readouterr().err
    assert main([*plan_args(root), "--environment", "no_such_env"]) == EXIT_USAGE
    assert main(["generate", "--root", root, "--batch-id", "never-planned", "--shard", "0"]) == EXIT_USAGE
    assert "rollout-ledger plan" in capsys.readouterr().err


def test_planning_again_is_a_no_op_and_a_different_config_is_refused(tmp_path, capsys):
    root = str(tmp_path)
    assert main(plan_args(root)) == 0
    assert main(plan_args(root)) == 0
    assert "already planned" in capsys.readouterr().out
    assert main(plan_args(root, "b-cli", "--seed", "7")) == EXIT_USAGE
    assert "different config" in capsys.readouterr().err


def test_sweep_refuses_an_uncommitted_shard(tmp_path, capsys):
    root = str(tmp_path)
    assert main(plan_args(root)) == 0
    assert main(["sweep", "--root", root, "--batch-id", "b-cli", "--shard", "0"]) == EXIT_FAILED
    assert "commit marker" in capsys.readouterr().err


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tasks.cli", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ.copy(),
        check=False,
    )


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_plan_and_generate_on_defaults_commit_a_shard_the_reader_accepts(backend, tmp_path, request):
    root = str(tmp_path / "runs") if backend == "local" else f"{request.getfixturevalue('s3_bucket')}/runs"
    planned = run_cli(*plan_args(root, f"b-cli-{backend}"))
    assert planned.returncode == 0, planned.stderr
    generated = run_cli("generate", "--root", root, "--batch-id", f"b-cli-{backend}", "--shard", "0", "--no-progress")
    assert generated.returncode == 0, generated.stderr[-3000:]
    summary = json.loads(generated.stdout)
    assert summary["rollouts"] == 4 and summary["attempt"] == 0
    ledger = LedgerReader(batch_store(root, f"b-cli-{backend}"), 0)
    assert len(ledger.receipts) == 4
    assert ledger.marker.counts.calls == summary["calls"] >= 4
    again = run_cli("generate", "--root", root, "--batch-id", f"b-cli-{backend}", "--shard", "0")
    assert again.returncode == 0 and json.loads(again.stdout)["already_committed"] is True
