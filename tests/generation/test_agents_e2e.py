"""Agents on the REAL model: one batch of a different agent shape per rollout, through finalize and both suites.

The agents (``agents_for_tests.py``) use the official ``openai`` client and the OpenAI Agents
SDK against the capture gateway of a generate attempt on the shared in-process vLLM engine:
multi-turn with tools, streaming, a retried call, a sub-agent, a compacted history, a call with
another rollout's key, and agents that crash or give no reward (one that hangs until ``timeout_s``
is in ``test_agent_rollouts.py``: its wait is the engine's idle time). Every chain is checked token
by token, then the batch is finalized, validated by the lineage and dataset suites, and published
(the failed rollouts masked with their reasons). Then the gateway's faults on the same engine: a
call still running when its episode returns, and a retry after a dropped connection.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tasks.batch import Batch
from tasks.config import ValidationSpec
from tasks.finalize.stage import FinalizeOptions
from tasks.generate import generate_shard
from tasks.pipeline import finalize_and_publish
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tasks.storage.ledger_reader import LedgerReader
from tests.generation import fault_agents

from .agents_for_tests import FAILING_SHAPES, SHAPES
from .chains import linearized, verified_sequences
from .configs import bundled_model_config
from .test_agent_faults import SlowWhenAsked, ledger_order, nothing_after_its_receipt
from .test_agent_rollouts import gateway_notes, staged_manifests
from .test_server_batches_e2e import dataset_rows

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def planned_agent_batch(tmp_path, function: str, tasks: list[dict], **fields) -> Batch:
    """A planned ``agent_callable`` batch under ``tmp_path/runs`` whose task file holds ``tasks``, one rollout each."""
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    options = {"function": function, "tasks": str(path), **fields.pop("environment_options", {})}
    config = bundled_model_config(
        environment="agent_callable", environment_options=options, num_tasks=len(tasks), group_size=1, **fields
    )
    batch = Batch.open(str(tmp_path / "runs"), config.batch_id)
    plan_batch(batch, config)
    return batch


def test_every_agent_shape_on_the_real_model_is_captured_exactly_and_published(vllm_engine, tmp_path):
    engine, loop = vllm_engine
    failing = [shape for shape in FAILING_SHAPES if shape != "hang"]
    shapes = [*SHAPES, *failing]
    batch = planned_agent_batch(
        tmp_path,
        "tests.generation.agents_for_tests:any_shape",
        [{"shape": shape, "a": 2 + i, "b": 3} for i, shape in enumerate(shapes)],
        batch_id="b-agents",
        environment_options={"timeout_s": 60},
        max_turns=8,
        max_in_flight=len(shapes),
        sampling=SamplingSettings(temperature=0.8, max_tokens=24),
        validation=ValidationSpec(max_invalid_row_rate=0.5, max_poisoned_rate=0.5),
    )
    root, config = str(tmp_path / "runs"), batch.config
    summary = generate_shard(batch, 0, engine=engine, run=loop.run, progress=False)
    shape_of = {p.rollout_id: json.loads(p.task_json)["shape"] for p in batch.shard_plan(0)}
    rollouts = {shape_of[rollout]: calls for rollout, calls in staged_manifests(batch).items()}
    receipts = {shape: receipt for shape, (receipt, _) in rollouts.items()}
    assert summary.ok == len(SHAPES), {s: (r.status, r.failure_reason, r.reward_info) for s, r in receipts.items()}
    failures = {shape: (receipts[shape].status, receipts[shape].failure_reason) for shape in failing}
    assert failures == {"crash": ("failed", "agent_error"), "no_reward": ("failed", "agent_no_reward")}
    assert "the agent's tool crashed" in json.loads(receipts["crash"].reward_info)["error"]

    chains = verified_sequences(batch.store, 0)
    for shape, (receipt, calls) in rollouts.items():
        if shape in failing:
            continue
        records = {record.call_id: record for record, _ in calls}
        chain = chains[receipt.rollout_id]
        assert chain[-1].call_id == receipt.terminal_call_id, shape
        for parent, child in itertools.pairwise(chain):  # children reuse their parent's exact tokens
            assert records[child.call_id].prev_len == records[parent.call_id].cum_len, shape
        assert linearized(chain).size == records[receipt.terminal_call_id].cum_len

    def reasons(shape: str) -> list[str | None]:
        return [gateway_notes(delta).get("root_reason") for _, delta in rollouts[shape][1]]

    assert reasons("retry") == [None, "retry", None, None]
    assert receipts["retry"].terminal_call_id == rollouts["retry"][1][3][0].call_id  # not the abandoned sibling
    assert reasons("sub_agent") == [None, "sub_agent", None]
    assert reasons("compacted") == [None, None, "compacted_history"]
    streamed = [record for record, _ in rollouts["streaming"][1]]
    assert len(streamed) == 2 and streamed[1].parent_call_id == streamed[0].call_id
    # A request with another rollout's key is counted for the attempt, never kept on either rollout.
    assert "refused_requests" not in json.loads(receipts["crossed_key"].reward_info)
    assert summary.gateway_auth_failures == 1
    tools_root = rollouts["tools"][1][0][1]
    assert "<tools>" in engine.tokenizer.decode(tools_root.token_ids_delta[tools_root.token_mask_delta == 0])

    published = finalize_and_publish(Batch.open(root, config.batch_id), FinalizeOptions(audit=False))
    assert published.published is not None and set(published.suites) == {"lineage", "dataset"}
    rows = dataset_rows(root, config.batch_id)
    assert set(rows) == set(shape_of)
    for rollout, row in rows.items():  # each row is its terminal's chain, token for token, or masked with a reason
        if shape_of[rollout] in failing:
            assert (row["sample_mask"], row["mask_reason"]) == (0, "rollout_failed"), shape_of[rollout]
        else:
            assert row["sample_mask"] == 1 and np.array_equal(row["input_ids"], linearized(chains[rollout]))


def test_an_independent_message_graph_on_the_real_model_prompts_each_call_afresh_and_is_published(
    vllm_engine, tmp_path
):
    engine, loop = vllm_engine
    batch = planned_agent_batch(
        tmp_path,
        "tests.generation.agents_for_tests:any_shape",
        [{"shape": "streaming", "a": i, "b": 5} for i in range(2)],
        batch_id="b-independent",
        message_graph="independent",
        sampling=SamplingSettings(temperature=0.8, max_tokens=16),
    )
    root, config = str(tmp_path / "runs"), batch.config
    assert generate_shard(batch, 0, engine=engine, run=loop.run, progress=False).ok == 2
    staged = staged_manifests(batch)
    for receipt, calls in staged.values():
        assert [record.parent_call_id for record, _ in calls] == [None, None]
        assert [gateway_notes(delta).get("root_reason") for _, delta in calls] == [None, "independent"]
        assert receipt.terminal_call_id == calls[1][0].call_id
    published = finalize_and_publish(Batch.open(root, config.batch_id), FinalizeOptions(audit=False))
    assert published.published is not None and set(published.suites) == {"lineage", "dataset"}
    # one trainable row per call, in ledger order, each exactly its call's staged tokens
    store = Batch.open(root, config.batch_id).store
    parts = sorted(Path(store.full_path("dataset")).glob("part-*.parquet"))
    rows = [row for part in parts for row in pq.read_table(part).to_pylist()]
    expected = [(rollout, delta) for rollout, (_, calls) in sorted(staged.items()) for _, delta in calls]
    assert [(row["rollout_id"], row["call_spans"][0]["call_id"]) for row in rows] == [
        (rollout, delta.call_id) for rollout, delta in expected
    ]
    for row, (_, delta) in zip(rows, expected, strict=True):
        assert row["sample_mask"] == 1 and row["num_turns"] == 1 and row["input_ids"] == delta.token_ids_delta.tolist()


def test_a_late_call_and_a_retried_dropped_connection_on_the_real_model_are_each_one_call_in_the_receipt(
    vllm_engine, tmp_path, monkeypatch
):
    """The real engine, slowed (``SlowWhenAsked``) on the requests the agents ask slowly: the episode returns
    while its call runs, or the connection drops once the call is admitted and the client retries."""
    engine, loop = vllm_engine
    slowed = SlowWhenAsked(engine)
    written = ledger_order(monkeypatch)
    shapes = ["late_call", "dropped_connection"]
    batch = planned_agent_batch(
        tmp_path,
        "tests.generation.fault_agents:by_shape",
        [{"shape": shape, "a": i, "b": 3} for i, shape in enumerate(shapes)],
        batch_id="b-agent-faults",
        sampling=SamplingSettings(temperature=0.8, max_tokens=16),
    )
    root, config = str(tmp_path / "runs"), batch.config
    summary = generate_shard(batch, 0, engine=slowed, run=loop.run, progress=False)

    assert summary.ok == 2
    assert fault_agents.SEEN[0] == {"timed_out": True} and fault_agents.SEEN[1]["tries"] == 2
    bundles = {b.rollout_id: b for b in LedgerReader(batch.store, 0).rollouts()}
    assert sorted(len(b.manifest) for b in bundles.values()) == [1, 2]  # one call per request the agents made
    assert all(b.receipt.num_calls == len(b.manifest) and b.receipt.status == "ok" for b in bundles.values())
    assert {f"chatcmpl-{b.manifest[0].call_id}" for b in bundles.values()} >= {fault_agents.SEEN[1]["id"]}
    assert nothing_after_its_receipt(written)
    finalize_and_publish(Batch.open(root, config.batch_id), FinalizeOptions(audit=False))
    rows = dataset_rows(root, config.batch_id)
    assert len(rows) == 2 and all(row["sample_mask"] == 1 for row in rows.values())
