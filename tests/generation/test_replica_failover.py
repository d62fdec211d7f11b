"""A replica lost mid-shard, over fake vLLM servers: its rollouts start again on the live one, in the same attempt.

Two fake servers (:mod:`tests.engines.fake_vllm_server`: real HTTP, real tokenizer, no model);
the second stops after it answered a few calls. The attempt goes on: the rollouts whose call it
held start again from their first turn on the first server (their earlier calls stay in the
ledger, off the chain), the others are undisturbed, and the shard commits in attempt 0. The
summary, the receipts and ``rollout-ledger status`` say where the calls ran and which rollouts
failed over.
"""

from __future__ import annotations

import json

import pytest

from tasks.batch import Batch
from tasks.config import EngineSpec
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shard
from tasks.plan import plan_batch
from tasks.status.gather import batch_status
from tasks.status.render import render_status
from tests.engines.fake_vllm_server import FakeVllmServer
from tests.engines.test_vllm_server_fault_trials import strike_at
from tests.generation.configs import bundled_model_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_lost_replica_s_rollouts_start_again_on_the_live_one_and_the_attempt_commits(tmp_path):
    live, lost = FakeVllmServer().start(), FakeVllmServer().start()
    try:
        for server in (live, lost):
            server.delay_s = 0.02  # calls overlap: the lost server holds calls in flight when it stops
        engine = EngineSpec("vllm_server", {"urls": [live.url, lost.url]})
        config = bundled_model_config(batch_id="b-failover", num_tasks=4, max_in_flight=4, engine=engine)
        root = str(tmp_path / "runs")
        plan_batch(Batch.open(root, config.batch_id), config)
        stopping = strike_at(lost, 3, lost.stop)  # its calls in flight then fail as a killed one's
        summary = generate_shard(Batch.open(root, config.batch_id), 0, progress=False)
        stopping.join(timeout=60)
    finally:
        for server in (live, lost):
            if server.started:
                server.stop()

    assert summary.attempt == 0 and summary.rollouts == config.num_rollouts
    assert summary.failovers and all(line.startswith("rollout ") for line in summary.failovers)
    assert all(f"server {lost.url}" in line for line in summary.failovers)
    assert summary.calls_by_replica[lost.url] >= 3 and summary.calls_by_replica[live.url] > 0

    batch = Batch.open(root, config.batch_id)
    tables = batch.ledger(0).tables
    infos = {r["rollout_id"]: json.loads(r["reward_info"]) for r in tables.receipts.to_pylist()}
    restarted = {rollout for rollout, info in infos.items() if "failed_over" in info}
    assert len(restarted) == len(summary.failovers)
    staged = finalize_batch(batch, FinalizeOptions(audit=False))  # the fake's logprobs are no model's
    assert staged.marker.rows == config.num_rollouts
    # Every restarted rollout replayed what it had committed (on either server) and sampled the rest on the
    # live one: its chain's calls of the lost server come first, and it replayed at least those.
    calls = tables.calls.to_pylist()
    for receipt in tables.receipts.to_pylist():
        if receipt["rollout_id"] not in restarted:
            continue
        assert receipt["status"] == "ok", receipt
        by_id = {c["call_id"]: c for c in calls if c["rollout_id"] == receipt["rollout_id"]}
        chain, call = [], by_id[receipt["terminal_call_id"]]
        while call is not None:
            chain.append(call["call_id"])
            call = by_id.get(call["parent_call_id"])
        chain.reverse()
        on_lost = [call not in live.answered for call in chain]
        assert on_lost == sorted(on_lost, reverse=True), "a call sampled after the failover ran on the lost server"
        assert sum(on_lost) <= infos[receipt["rollout_id"]]["resumed"]["replayed"]
        assert receipt["num_calls"] == len(by_id) > len(chain) or set(by_id) == set(chain)

    shard = batch_status(batch).shards[0].committed
    assert shard is not None and shard.rollouts_failed_over == len(restarted)
    assert shard.calls_by_server[live.url] > 0 and shard.calls_by_server[lost.url] >= 3
    text = render_status(batch_status(batch))
    assert f"{len(restarted)} rollout(s) restarted on a live server" in text and f"{lost.url} " in text
