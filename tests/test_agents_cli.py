"""The issue's "done when" on the command line: an agent command that knows only its three variables, published.

``examples/command_agent.py`` (the official ``openai`` client, a tool, several turns) runs once per
rollout under ``rollout-ledger plan / generate / finalize`` against the test run's vLLM server.
The published dataset's rows are the staged chains, token for token.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from tasks.batch import Batch

from .generation.chains import linearized, verified_sequences
from .test_cli import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_an_agent_command_is_planned_generated_finalized_and_published_token_exactly(vllm_server, tmp_path):
    root, batch_id = str(tmp_path / "runs"), "b-agent-cli"
    engine = [f"--engine-option={key}={json.dumps(v)}" for key, v in vllm_server.engine_options().items()]
    planned = run_cli(
        "plan", "--root", root, "--batch-id", batch_id, "--num-tasks", "3", "--group-size", "2", "--shards", "1",
        "--max-turns", "4", "--max-tokens", "32", "--engine", "vllm_server", *engine,
        "--environment", "agent_command",
        "--env-option", f"command={json.dumps([sys.executable, 'examples/command_agent.py'])}",
        "--env-option", "tasks=examples/arithmetic_tasks.jsonl",
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    generated = run_cli("generate", "--root", root, "--batch-id", batch_id, "--all-shards", "--no-progress")
    assert generated.returncode == 0, generated.stderr[-3000:]
    (summary,) = json.loads(generated.stdout)
    assert summary["rollouts"] == 6 and summary["ok"] == 6, generated.stderr[-3000:]
    finalized = run_cli("finalize", "--root", root, "--batch-id", batch_id, "--no-audit")
    assert finalized.returncode == 0, finalized.stderr[-3000:]
    assert json.loads(finalized.stdout)["published"]

    batch = Batch.open(root, batch_id)
    options = batch.config.environment_options
    assert options["tasks"].startswith("file://") and len(options["sha256"]) == 64  # the task file is pinned
    chains = verified_sequences(batch.store, 0)
    parts = sorted((tmp_path / "runs" / "batches" / batch_id / "dataset").glob("part-*.parquet"))
    rows = [row for part in parts for row in pq.read_table(part).to_pylist()]
    assert len(rows) == 6 and all(row["sample_mask"] == 1 for row in rows)
    for row in rows:
        assert np.array_equal(row["input_ids"], linearized(chains[row["rollout_id"]])), row["rollout_id"]
