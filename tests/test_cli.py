"""The ``rollout-ledger`` command line: exit codes, one-line errors, flags documented, plan + generate end to end."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.cli.main import build_parser, main
from tasks.errors import EXIT_CONFLICT, EXIT_USAGE
from tasks.storage.ledger_reader import LedgerReader

DOCS = Path(__file__).resolve().parents[1] / "docs"


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


def one_line_error(capsys, code: int, expected_code: int, *needles: str) -> str:
    err = capsys.readouterr().err
    assert code == expected_code, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_argument_errors_exit_2(tmp_path, capsys):
    root = str(tmp_path)
    with pytest.raises(SystemExit) as caught:
        main(["plan", "--root", root])
    assert caught.value.code == EXIT_USAGE
    with pytest.raises(SystemExit) as caught:
        main(["generate", "--root", root, "--batch-id", "b", "--shard", "-1"])
    assert caught.value.code == EXIT_USAGE
    assert "a shard is a number >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        main(plan_args(root, "b", "--engine", "megatronn"))
    assert caught.value.code == EXIT_USAGE
    assert "invalid choice: 'megatronn'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--batch-id", "../escape"], ["batch_id must be a str matching", "'../escape'"]),
        (["--environment", "no_such_env"], ["no_such_env", ".parquet, .jsonl, .json"]),
        (["--environment", "prompts.csv"], ["prompts.csv", "supported suffixes: .parquet, .jsonl, .json"]),
        (["--temperature", "-1"], ["plan flags", "temperature must be a finite number in [0, 100], got -1.0"]),
        (["--top-k", "0"], ["top_k"]),
        (["--engine-option", "max_modle_len=2048"], ["unknown vllm engine option(s) ['max_modle_len']"]),
        (["--weight-version", "-3"], ["weight_version must be an int >= 0"]),
        (["--max-poisoned-rate", "nan"], ["max_poisoned_rate must be a finite number in [0, 1], got nan"]),
        (["--shards", "9"], ["shards (9) cannot exceed num_tasks (2)"]),
        (["--model", "/no/such/folder"], ["/no/such/folder", "not_a_directory"]),
    ],
)
def test_plan_refuses_what_generate_would_refuse_before_writing_anything(tmp_path, capsys, extra, needles):
    root = str(tmp_path / "runs")
    args = plan_args(root)
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    one_line_error(capsys, main(args), EXIT_USAGE, *needles)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("batch.json"))


def test_prompt_file_mistakes_are_one_line_errors_naming_the_file(tmp_path, capsys):
    root = str(tmp_path / "runs")
    directory = tmp_path / "folder.jsonl"
    directory.mkdir()
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "Say 1.", "ground_truth": "1"}\n{"prompt": "Say 2.", "ground_truth": \n')
    short = tmp_path / "short.jsonl"
    short.write_text('{"prompt": "Say 1.", "ground_truth": "1"}\n')

    def plan(path: Path, batch: str, tasks: str = "1") -> int:
        args = plan_args(root, batch, "--group-size", "1")
        args[args.index("--environment") + 1] = str(path)
        args[args.index("--num-tasks") + 1] = tasks
        return main(args)

    one_line_error(capsys, plan(directory, "b-dir"), EXIT_USAGE, str(directory), "cannot be read")
    one_line_error(capsys, plan(broken, "b-json"), EXIT_USAGE, str(broken), "line 2", "invalid JSON")
    one_line_error(capsys, plan(short, "b-short", "2"), EXIT_USAGE, "has 1 rows, 2 tasks asked")
    assert plan(short, "b-ok") == 0
    config = json.loads((tmp_path / "runs/batches/b-ok" / layout.plan_config()).read_text())
    assert config["environment"] == f"file://{short}"
    assert config["environment_options"]["sha256"] and config["environment_options"]["reward"]


def test_planning_again_is_a_no_op_and_a_different_config_is_a_conflict_naming_the_fields(tmp_path, capsys):
    root = str(tmp_path)
    assert main(plan_args(root)) == 0
    out = capsys.readouterr().out
    assert "model        bundled:smollm2-135m-instruct" in out and re.search(r"weights +sha256 [0-9a-f]{64}", out)
    assert main(plan_args(root)) == 0
    assert "already planned" in capsys.readouterr().out
    one_line_error(
        capsys,
        main(plan_args(root, "b-cli", "--seed", "7", "--temperature", "0.5")),
        EXIT_CONFLICT,
        "differing: sampling.temperature, seed",
        "plan under a new batch id",
    )


def test_generate_and_sweep_mistakes_are_one_line_usage_errors(tmp_path, capsys):
    root = str(tmp_path)
    assert main(plan_args(root)) == 0
    capsys.readouterr()
    never = ["generate", "--root", root, "--batch-id", "never-planned", "--shard", "0"]
    one_line_error(capsys, main(never), EXIT_USAGE, "no batch 'never-planned' under", "It holds 1 batch: b-cli")
    model = ["generate", "--root", root, "--batch-id", "b-cli", "--shard", "0", "--model", "/elsewhere"]
    one_line_error(capsys, main(model), EXIT_USAGE, "fixed at plan time")
    out_of_range = ["generate", "--root", root, "--batch-id", "b-cli", "--shard", "5"]
    one_line_error(capsys, main(out_of_range), EXIT_USAGE, "shard 5 is out of range")
    sweep = ["sweep", "--root", root, "--batch-id", "b-cli", "--shard", "0"]
    one_line_error(capsys, main(sweep), EXIT_USAGE, "no commit marker")


def test_s3_errors_name_the_bucket_and_the_aws_variables_read(s3_endpoint, capsys):
    root = "s3://no-such-bucket-rl/runs"
    line = one_line_error(capsys, main(plan_args(root)), EXIT_USAGE, "no-such-bucket-rl")
    assert "AWS_ENDPOINT_URL" in line and "AWS_ACCESS_KEY_ID" in line
    assert "testing" not in line  # names of variables, never their values


def test_every_flag_of_every_command_is_documented_with_the_command():
    text = (DOCS / "operations.md").read_text() + (DOCS / "configuration.md").read_text()  # plan's batch fields
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = []
    for name, command in commands.items():
        assert f"rollout-ledger {name}" in text, f"docs/operations.md does not describe `rollout-ledger {name}`"
        for action in command._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and f"`{flag}" not in text:
                    missing.append(f"{name} {flag}")
        assert all(a.help for a in command._actions), f"{name} has a flag without help text"
    assert not missing, f"docs/operations.md does not list {missing}"


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
def test_plan_and_generate_commit_a_shard_the_reader_accepts(s3_bucket, vllm_server):
    """On S3, with the test run's vLLM server (the CLI on local disk: the agent CLI test and the in-process
    engine's interruption tests)."""
    backend, root = "s3", f"{s3_bucket}/runs"
    options = vllm_server.engine_options()
    engine = ("--engine", "vllm_server", *(f"--engine-option={key}={json.dumps(v)}" for key, v in options.items()))
    planned = run_cli(*plan_args(root, f"b-cli-{backend}"), *engine)
    assert planned.returncode == 0, planned.stderr
    generated = run_cli("generate", "--root", root, "--batch-id", f"b-cli-{backend}", "--shard", "0", "--no-progress")
    assert generated.returncode == 0, generated.stderr[-3000:]
    (summary,) = json.loads(generated.stdout)
    assert summary["rollouts"] == 4 and summary["attempt"] == 0
    assert "starting the engine (about" in generated.stderr and "engine log:" in generated.stderr
    assert "mean reward" in generated.stderr and "truncation rate" in generated.stderr
    ledger = LedgerReader(Batch.open(root, f"b-cli-{backend}").store, 0)
    assert len(ledger.receipts) == 4
    assert ledger.marker.counts.calls_used == summary["calls"] >= 4
    assert ledger.marker.counts.calls_recorded == summary["calls_recorded"] >= summary["calls"]
    again = run_cli("generate", "--root", root, "--batch-id", f"b-cli-{backend}", "--all-shards")
    assert again.returncode == 0 and json.loads(again.stdout)[0]["already_committed"] is True
    assert "starting the engine" not in again.stderr


def test_finalize_prints_the_training_signal_and_the_dataset_as_json(tmp_path, capsys, tokenizer):
    import asyncio

    from tasks.generate import generate_shards

    from .generation.fakes import FakeScriptedEngine

    root = str(tmp_path / "runs")
    assert main(plan_args(root, "b-fin", "--shards", "2", "--num-tasks", "2")) == 0
    engine = FakeScriptedEngine(tokenizer, reply=lambda request: "5")
    generate_shards(Batch.open(root, "b-fin"), [0, 1], engine=engine, run=asyncio.run, progress=False)
    capsys.readouterr()
    assert main(["finalize", "--root", root, "--batch-id", "b-fin", "--no-audit"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert (result["rows"], result["partial"], result["missing_shards"]) == (4, False, [])
    assert "mean reward" in captured.err and "groups have zero reward variance" in captured.err


def test_an_unreachable_server_at_plan_time_is_named_without_generates_retry_advice():
    from tasks.entry_point import classify_error
    from tasks.errors import EngineDeadError

    error = EngineDeadError("server http://127.0.0.1:9 is unreachable: ConnectError: All connection attempts failed")
    code, line = classify_error(error, "plan", "/runs")
    assert line == f"rollout-ledger plan: failed: {error}" and code == 1
    code, line = classify_error(error, "generate", "/runs")
    assert "the engine died" in line and "run generate again to adopt them" in line


def test_plan_against_the_real_server_with_a_wrong_key_says_how_to_give_the_key(vllm_server, tmp_path, capsys):
    """The test run's server (shared: only read from), asked with a wrong key."""
    from tasks.models.bundled import cache_dir

    wrong = tmp_path / "wrong.key"
    wrong.write_text("not-the-key-0417\n")
    options = vllm_server.engine_options(api_key_file=str(wrong))
    engine = ["--engine", "vllm_server", *(f"--engine-option={key}={json.dumps(v)}" for key, v in options.items())]
    line = one_line_error(capsys, main([*plan_args(str(tmp_path / "runs"), "b-wrong-key"), *engine]), EXIT_USAGE)
    port = vllm_server.url.rpartition(":")[2]
    assert not (cache_dir() / "serve" / f"port-{port}.key").exists()  # the server's key is in its own cache
    assert line == (
        f"rollout-ledger plan: error: server {vllm_server.url} refused the key in {wrong} (HTTP 401 on /v1/models); "
        "give the servers' key as the engine option api_key_file (--engine-option api_key_file=PATH; refit: "
        "--api-key-file PATH), as $ROLLOUT_LEDGER_SERVER_API_KEY, or under Airflow as the password of the batch's "
        f"rollout_servers connection; `rollout-ledger serve` writes its key to {cache_dir()}/serve/port-<port>.key"
    )
    assert "not-the-key-0417" not in line and vllm_server.key not in line
