"""Two shards generated at once through one real vLLM server give the dataset the in-process engine gives.

The same greedy batch is planned twice: on the test run's server (``vllm_server``), with one
``rollout-ledger generate`` process per shard running at the same time, and on the in-process
engine. The served batch passes both suites and is published, and the server's log shows one
engine start in the whole test run. Both datasets hold the same rows: token ids, loss masks,
rewards and masks exactly; logprobs to float32 rounding (the server batched the two shards'
calls together, the in-process engine each shard's alone, and a different batch sums in a
different order).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tasks.batch import Batch
from tasks.config import EngineSpec
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shards
from tasks.pipeline import finalize_and_publish
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings

from .configs import bundled_model_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
COMPARED = ("input_ids", "loss_mask", "reward", "sample_mask", "mask_reason")
LOGPROB_TOLERANCE = 1e-4
ENGINE_START = "Initializing a V1 LLM engine"  # vLLM's log line, once per engine start


def dataset_rows(root: str, batch_id: str) -> dict[str, dict]:
    store = Batch.open(root, batch_id).store
    parts = sorted(Path(store.full_path("dataset")).glob("part-*.parquet"))
    return {row["rollout_id"]: row for part in parts for row in pq.read_table(part).to_pylist()}


def test_two_shards_at_once_on_one_server_give_the_in_process_engines_dataset(vllm_server, vllm_engine, tmp_path):
    root = str(tmp_path / "runs")
    greedy = {"num_tasks": 2, "shards": 2, "sampling": SamplingSettings(temperature=0.0, max_tokens=16)}
    served = bundled_model_config(
        batch_id="b-served", engine=EngineSpec("vllm_server", vllm_server.engine_options()), **greedy
    )
    in_process = bundled_model_config(batch_id="b-in-process", **greedy)
    for config in (served, in_process):
        plan_batch(Batch.open(root, config.batch_id), config)

    argv = [sys.executable, "-m", "tasks.cli", "generate", "--root", root, "--batch-id", served.batch_id]
    argv.append("--no-progress")
    shards = [
        subprocess.Popen([*argv, "--shard", str(shard)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for shard in range(served.shards)
    ]
    for process in shards:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr.decode()[-3000:]
    engine, loop = vllm_engine
    generate_shards(Batch.open(root, in_process.batch_id), [0, 1], engine=engine, run=loop.run, progress=False)
    published = finalize_and_publish(Batch.open(root, served.batch_id), FinalizeOptions(audit=False))
    assert published.published is not None and set(published.suites) == {"lineage", "dataset"}
    finalize_batch(Batch.open(root, in_process.batch_id), FinalizeOptions(audit=False))  # the rows are compared here
    assert Path(vllm_server.log).read_text().count(ENGINE_START) == 1, "the server started its engine again"

    on_server, on_engine = dataset_rows(root, served.batch_id), dataset_rows(root, in_process.batch_id)
    assert len(on_server) == served.num_rollouts and on_server.keys() == on_engine.keys()
    assert sum(row["sample_mask"] for row in on_server.values()) > 0
    for rollout_id, row in on_server.items():
        assert {c: row[c] for c in COMPARED} == {c: on_engine[rollout_id][c] for c in COMPARED}, rollout_id
        differ = np.abs(np.array(row["logprobs"]) - np.array(on_engine[rollout_id]["logprobs"])).max()
        assert differ <= LOGPROB_TOLERANCE, f"{rollout_id}: logprobs differ by up to {differ}"
