"""What a generate attempt keeps of the gateway's refusals: capped on each receipt, auth failures in its summary.

Real gateway, storage and ``openai`` clients over a FAKE engine (``FakeScriptedEngine``: it answers
every prompt with a fixed text, no model).
"""

from __future__ import annotations

import asyncio
import json

from tasks.batch import Batch
from tasks.gateway.app import MAX_RECORDED_REFUSALS
from tasks.generate import generate_shard
from tasks.plan import plan_batch
from tasks.storage.ledger_reader import LedgerReader
from tests.generation.configs import fake_model_config
from tests.generation.fakes import FakeScriptedEngine

from .gateway_agents import PROBES, REFUSED


def test_refusals_are_capped_on_each_receipt_and_auth_failures_counted_in_the_summary(tmp_path, tokenizer):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"a": i, "b": 1}) + "\n" for i in range(2)))
    options = {"function": "tests.gateway.gateway_agents:probing_agent", "tasks": str(tasks)}
    config = fake_model_config(
        environment="agent_callable", environment_options=options, num_tasks=2, group_size=1, shards=1
    )
    batch = Batch.open(str(tmp_path / "runs"), config.batch_id)
    plan_batch(batch, config)
    engine = FakeScriptedEngine(tokenizer, reply=lambda request: "The answer is 1.")
    summary = generate_shard(batch, 0, engine=engine, run=asyncio.run, progress=False)

    assert (summary.ok, summary.gateway_auth_failures) == (2, 2 * PROBES)
    for bundle in LedgerReader(batch.store, 0).rollouts():
        info = json.loads(bundle.receipt.reward_info)
        assert len(info["refused_requests"]) == MAX_RECORDED_REFUSALS
        assert info["refused_requests_dropped"] == REFUSED - MAX_RECORDED_REFUSALS
        assert all(refused.startswith("400 ") for refused in info["refused_requests"])  # no 401 among them
