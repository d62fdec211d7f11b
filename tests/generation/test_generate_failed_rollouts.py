"""A shard whose every rollout failed: ``rollout-ledger generate`` exits 2 naming why, the lineage suite says failed.

The batch runs an agent command that exits 1 at once with a traceback on stderr (as the worked
example did on a Python without ``openai``), on engine ``vllm_server`` over a fake server
(:mod:`tests.engines.fake_vllm_server`: real HTTP, no model; the agent never calls it). The real
CLI commits the shard and exits 2 with the failure reasons, their counts and the agents' stderr as
the receipts recorded it (the rollout's key redacted); the generate worker an Airflow task starts
exits 2 on the committed shard too, without an engine (a retry or a cleared task fails at once the
same way); the lineage suite fails the batch on ``failed_rollout_rate`` (examples: the reasons),
never on ``poisoned_rollout_rate``, and the report's table says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.batch import Batch
from tasks.cli.main import main as cli_main
from tasks.engines.registry import engine_names
from tasks.engines.startup import START_SECONDS, expected_start_seconds
from tasks.errors import EXIT_OK, EXIT_USAGE
from tasks.generate.console import check_rollouts, shard_lines
from tasks.generate.summary import RolloutsFailedError, ShardSummary
from tasks.generate.worker import main as worker_main
from tasks.report.gather import gather_report
from tasks.report.render import render_report
from tasks.validate import validate_lineage
from tests.test_cli import run_cli

AGENT = Path(__file__).parent / "agent_scripts" / "failing_agent.py"
BATCH = "b-agents-fail"
STDERR_LINE = "ModuleNotFoundError: No module named 'openai' (key [redacted])"


@pytest.fixture
def failing_registry(tmp_path, monkeypatch) -> str:
    """An environment registry declaring the failing agent (what a triggered batch's worker may run)."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"a": i, "b": i + 1}) + "\n" for i in range(4)))
    registry = tmp_path / "environments.yaml"
    entry = {
        "description": "an agent that fails at once (tests)",
        "kind": "agent_command",
        "options": {"command": ["{python}", str(AGENT)], "tasks": str(tasks), "timeout_s": 60},
    }
    registry.write_text(json.dumps({"environments": {"failing_agent": entry}}))  # JSON is YAML
    monkeypatch.setenv("ROLLOUT_LEDGER_ENVIRONMENTS", str(registry))
    return "failing_agent"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_shard_whose_agents_all_failed_exits_2_naming_why_and_validates_as_failed(tmp_path, failing_registry, capsys):
    from tests.engines.fake_vllm_server import FakeVllmServer  # hashes the bundled model's weights on import

    server = FakeVllmServer().start()
    try:
        root = str(tmp_path / "runs")
        planned = cli_main(
            ["plan", "--root", root, "--batch-id", BATCH, "--environment", failing_registry, "--num-tasks", "2",
             "--group-size", "2", "--shards", "1", "--engine", "vllm_server",
             "--engine-option", f"urls={json.dumps([server.url])}"]
        )  # fmt: skip
        assert planned == EXIT_OK, capsys.readouterr().err
        generated = run_cli("generate", "--root", root, "--batch-id", BATCH, "--all-shards", "--no-progress")
        capsys.readouterr()
        # The Airflow task's worker, on the committed shard (a retry, a cleared task): the same exit, no engine.
        again = worker_main(["--root", root, "--batch-id", BATCH, "--shard", "0", "--try-number", "2"])
        worker_out, worker_err = capsys.readouterr()
    finally:
        server.stop()

    assert generated.returncode == EXIT_USAGE, generated.stderr[-3000:]
    (summary,) = json.loads(generated.stdout)  # the JSON summary is printed before the error
    assert summary["rollouts"] == summary["failed"] == 4 and summary["already_committed"] is False
    assert summary["failed_reasons"] == {"agent_exit": 4}
    assert summary["failed_errors"]["agent_exit"].startswith("the command exited with 1: Traceback")
    assert summary["training_signal"]["failed_by_reason"] == {"agent_exit": 4}
    err = generated.stderr
    assert "starting the engine (about " in err
    assert "NO TRAINING SIGNAL: all 2 groups have zero reward variance (every advantage is 0); no group has two " in err
    assert "4 failed (their agent or environment gave no reward): check the agent command and its stderr" in err
    assert "easier or harder" not in err
    assert "  failed rollouts by reason: agent_exit 4\n" in err
    assert "    | the command exited with 1: Traceback (most recent call last):\n" in err
    assert f"    | {STDERR_LINE}\n" in err
    last = err.strip().splitlines()[-1]
    assert last == (
        "rollout-ledger generate: error: every rollout of shard 0 failed (4 rollouts: agent_exit 4); agent_exit: "
        f'"the command exited with 1: Traceback (most recent call last): ... {STDERR_LINE}". The shard is committed '
        "and nothing is lost, but there is nothing to train on, and generating again changes nothing: fix what the "
        "failures name (an agent's command, as its stderr above shows; a scorer; timeout_s) and plan a new batch id"
    )

    assert again == EXIT_USAGE and "starting the engine" not in worker_err
    assert json.loads(worker_out)[0]["already_committed"] is True
    assert worker_err.strip().splitlines()[-1] == last

    outcome = validate_lineage(Batch.open(root, BATCH))
    by_name = {e.name: e for e in outcome.summary.expectations}
    assert outcome.status == "failed"
    failed = by_name["failed_rollout_rate"]
    assert not failed.success and failed.unexpected_count == 4 and failed.examples == ("agent_exit",)
    assert failed.observed == 1.0 and failed.threshold == 0.2
    poisoned = by_name["poisoned_rollout_rate"]
    assert poisoned.success and poisoned.unexpected_count == 0 and poisoned.threshold == 0.0
    page = render_report(gather_report(Batch.open(root, BATCH)))  # the overview page's table of what failed
    (row,) = [row for row in page.split("<tr>") if "failed_rollout_rate" in row and "<b>" in row]
    assert "<code>agent_exit</code>" in row and '<td class="num">4</td>' in row
    assert not [row for row in page.split("<tr>") if "<b>poisoned_rollout_rate</b>" in row]


def summary(shard: int = 0, *, ok: int = 0, poisoned: int = 0, failed: int = 4, **more) -> ShardSummary:
    fields = {"batch_id": "b", "attempt": 0, "adopted": 0, "calls": 0, "failures": 0, "generated_tokens": 0}
    rollouts = ok + poisoned + failed
    fields |= {"seconds": 1.0, "already_committed": False, "swept": 0}
    return ShardSummary(shard=shard, rollouts=rollouts, ok=ok, poisoned=poisoned, failed=failed, **fields | more)


def test_the_failed_lines_show_the_first_lines_of_each_leading_reason_s_recorded_error():
    traceback = (
        "the command exited with 1: Traceback (most recent call last):\n"
        + "".join(f'  File "a.py", line {n}, in f{n}\n' for n in range(10))
        + "ValueError: the tool broke"
    )
    shown = shard_lines(
        summary(
            failed_reasons={"agent_exit": 3, "agent_timeout": 1},
            failed_errors={"agent_exit": traceback, "agent_timeout": "the agent did not finish within timeout_s=5"},
        )
    )
    start = shown.index("  failed rollouts by reason: agent_exit 3, agent_timeout 1")
    assert shown[start + 1 :] == [
        "  agent_exit: the error most of its receipts recorded (reward_info.error):",
        "    | the command exited with 1: Traceback (most recent call last):",
        *(f'    |   File "a.py", line {n}, in f{n}' for n in range(4)),
        "    | ... 6 more line(s), the last:",
        "    | ValueError: the tool broke",
        "  agent_timeout: the error most of its receipts recorded (reward_info.error):",
        "    | the agent did not finish within timeout_s=5",
    ]
    assert not any("failed rollouts" in line for line in shard_lines(summary(ok=4, failed=0)))


def test_only_a_shard_whose_every_rollout_failed_ends_the_run_with_exit_2():
    check_rollouts([summary(ok=1, failed=3), summary(shard=1, poisoned=4, failed=0), summary(shard=2, failed=0)])
    failed = [
        summary(failed_reasons={"agent_exit": 4}, failed_errors={"agent_exit": "the command exited with 1: boom"}),
        summary(shard=1, ok=2, failed=2),
        summary(shard=3, failed=2, failed_reasons={"agent_exit": 1, "scorer_error": 1}),
    ]
    with pytest.raises(RolloutsFailedError) as raised:
        check_rollouts(failed)
    assert raised.value.exit_code == EXIT_USAGE and raised.value.retryable is False
    assert str(raised.value).startswith(
        'every rollout of shards 0, 3 failed (6 rollouts: agent_exit 5, scorer_error 1); agent_exit: "the command '
        'exited with 1: boom". The shards are committed and nothing is lost'
    )


def test_each_registered_engine_has_its_start_figure_which_the_docs_quote(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_LEDGER_HOME", str(tmp_path))  # nothing measured on this "machine" yet
    assert set(START_SECONDS) == set(engine_names())
    operations = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    for engine, seconds in START_SECONDS.items():
        assert expected_start_seconds(engine) == seconds
        assert f"| `{engine}` | about {seconds:.0f} s |" in operations, engine  # the table of "Starting the engine"
