"""Agent rollouts behind the capture gateway, over a fake scripted engine (real tokenizer, storage, gateway, clients).

The agents are real (``tests/generation/agents_for_tests.py`` on the official ``openai`` client,
``agent_scripts/scripted_agent.py`` as a command); only the engine is a fake, so that each
message-graph shape is checked call by call in a second or two.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.errors import EngineDeadError
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shard
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import CommitCoordinates

from .chains import linearized, verified_sequences
from .configs import fake_model_config
from .fakes import FakeScriptedEngine

AGENTS = "tests.generation.agents_for_tests"
SCRIPT = Path(__file__).parent / "agent_scripts" / "scripted_agent.py"
QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")


def arithmetic_engine(tokenizer) -> FakeScriptedEngine:
    """Calls the add tool when tools are offered and no tool answered yet; else answers the sum (a fake model)."""

    def reply(request) -> str:
        prompt = tokenizer.decode(list(request.prompt_token_ids))
        asked = QUESTION.findall(prompt)
        a, b = map(int, asked[-1]) if asked else (0, 0)
        tool_answered = "<|im_start|>tool" in prompt
        if ("<tools>" in prompt or "TOOLS:" in prompt) and not tool_answered:
            return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
        return f"The answer is {a + b}."

    return FakeScriptedEngine(tokenizer, reply=reply)


@pytest.fixture
def tasks_file(tmp_path) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"a": i + 2, "b": 3 * i + 1}) + "\n" for i in range(4)))
    return path


def run_agents(tmp_path, engine, environment: str, options: dict, **overrides):
    shape = {"num_tasks": 2, "group_size": 2, "shards": 1} | overrides
    config = fake_model_config(environment=environment, environment_options=options, **shape)
    batch = Batch.open(str(tmp_path / "runs"), config.batch_id)
    plan_batch(batch, config)
    summary = generate_shard(batch, 0, engine=engine, run=asyncio.run, progress=False)
    return batch, summary


def staged_manifests(batch: Batch):
    """rollout id -> (receipt, [(call record, staged delta)] in call order) of every rollout of shard 0."""
    ledger = LedgerReader(batch.store, 0)
    reader = StagedReader(batch.store, segment_sha256=ledger.segment_sha256)
    out = {}
    for bundle in ledger.rollouts():
        keys = [(c.staging_key, CommitCoordinates(c.staging_segment, c.staging_row)) for c in bundle.manifest]
        out[bundle.rollout_id] = (bundle.receipt, list(zip(bundle.manifest, reader.fetch_records(keys), strict=True)))
    return out


def gateway_notes(delta) -> dict:
    return json.loads(delta.extras_json).get("gateway", {}) if delta.extras_json != "null" else {}


def test_a_tool_using_agent_is_captured_token_exactly_with_its_tool_call_spliced(tmp_path, tokenizer, tasks_file):
    engine = arithmetic_engine(tokenizer)
    options = {"function": f"{AGENTS}:tool_agent", "tasks": str(tasks_file)}
    batch, summary = run_agents(tmp_path, engine, "agent_callable", options)
    assert (summary.rollouts, summary.ok, summary.calls) == (4, 4, 8)
    chains = verified_sequences(batch.store, 0)
    for receipt, calls in staged_manifests(batch).values():
        assert receipt.reward == 1.0 and receipt.terminal_selection == "declared"
        (first, first_delta), (second, _) = calls
        assert "<tool_call>" in engine.results[first.call_id].text and gateway_notes(first_delta) == {}
        assert second.parent_call_id == first.call_id  # the tool result extends the tool call: a child
        request = next(r for r in engine.requests if r.request_id == second.call_id)
        parent = next(r for r in engine.requests if r.request_id == first.call_id)
        sampled = [*parent.prompt_token_ids, *engine.results[first.call_id].token_ids]
        assert list(request.prompt_token_ids[: len(sampled)]) == sampled
        exact = np.array([*request.prompt_token_ids, *engine.results[second.call_id].token_ids])
        assert np.array_equal(linearized(chains[receipt.rollout_id]), exact)


def test_a_retried_call_is_a_sibling_or_a_retry_root_and_never_the_terminal(tmp_path, tokenizer, tasks_file):
    options = {"function": f"{AGENTS}:retrying_agent", "tasks": str(tasks_file)}
    batch, summary = run_agents(tmp_path, arithmetic_engine(tokenizer), "agent_callable", options)
    assert summary.ok == 4
    for receipt, calls in staged_manifests(batch).values():
        records = [record for record, _ in calls]
        assert [gateway_notes(delta).get("root_reason") for _, delta in calls] == [None, "retry", None, None]
        assert [r.parent_call_id for r in records] == [None, None, records[1].call_id, records[1].call_id]
        assert receipt.terminal_call_id == records[3].call_id  # named by the response id the agent reported
        assert receipt.terminal_selection == "declared"


def test_a_sub_agent_is_its_own_root_and_the_main_history_stays_one_chain(tmp_path, tokenizer, tasks_file):
    options = {"function": f"{AGENTS}:sub_agent", "tasks": str(tasks_file)}
    batch, summary = run_agents(tmp_path, arithmetic_engine(tokenizer), "agent_callable", options)
    assert summary.ok == 4
    for receipt, calls in staged_manifests(batch).values():
        records = [record for record, _ in calls]
        assert [gateway_notes(delta).get("root_reason") for _, delta in calls] == [None, "sub_agent", None]
        assert [r.parent_call_id for r in records] == [None, None, records[0].call_id]
        assert receipt.terminal_call_id == records[2].call_id


def test_a_compacted_history_is_a_new_root_with_its_reason(tmp_path, tokenizer, tasks_file):
    options = {"function": f"{AGENTS}:compacting_agent", "tasks": str(tasks_file)}
    batch, summary = run_agents(tmp_path, arithmetic_engine(tokenizer), "agent_callable", options)
    assert summary.ok == 4
    for receipt, calls in staged_manifests(batch).values():
        records = [record for record, _ in calls]
        assert [gateway_notes(delta).get("root_reason") for _, delta in calls] == [None, None, "compacted_history"]
        assert records[1].parent_call_id == records[0].call_id and records[2].parent_call_id is None
        assert receipt.terminal_call_id == records[2].call_id and receipt.reward == 1.0


def test_a_call_offering_other_tools_is_a_new_root_that_sees_them_never_a_splice(tmp_path, tokenizer, tasks_file):
    engine = arithmetic_engine(tokenizer)
    options = {"function": "tests.generation.graph_agents:tools_changing_agent", "tasks": str(tasks_file)}
    batch, summary = run_agents(tmp_path, engine, "agent_callable", options)
    assert summary.ok == 4
    for receipt, calls in staged_manifests(batch).values():
        records = [record for record, _ in calls]
        reasons = [gateway_notes(delta).get("root_reason") for _, delta in calls]
        assert reasons == [None, "tools_changed", "tools_changed"]
        assert [r.parent_call_id for r in records] == [None, None, None]
        asked = {r.request_id: r.prompt_token_ids for r in engine.requests}
        prompts = [tokenizer.decode(asked[record.call_id]) for record in records]
        assert '"name": "mul"' not in prompts[0] and '"name": "mul"' in prompts[1]  # the new tools, rendered
        assert "<tools>" not in prompts[2]  # tool_choice "none": none offered
        assert all("<|im_start|>tool" in prompt for prompt in prompts[1:])  # the whole history, rendered afresh
        assert receipt.terminal_call_id == records[2].call_id and receipt.reward == 1.0


# Per agent environment: the task field naming what an agent does, the one that answers, how a crash fails the
# rollout, and the options (timeout_s: an agent command's process answers in about a second, a callable at once; both
# leave room on a loaded CI machine).
MISBEHAVING = {
    "agent_command": ("behavior", "answer", "agent_exit", {"command": [sys.executable, str(SCRIPT)], "timeout_s": 10}),
    "agent_callable": ("shape", "tools", "agent_error", {"function": f"{AGENTS}:any_shape", "timeout_s": 5}),
}


@pytest.mark.parametrize("environment", sorted(MISBEHAVING))
def test_an_agent_that_crashes_hangs_or_gives_no_reward_fails_only_its_rollout(environment, tmp_path, tokenizer):
    field, answering, crashed, options = MISBEHAVING[environment]
    tasks = tmp_path / "agents.jsonl"
    kinds = [answering, "crash", "hang", "no_reward"]
    tasks.write_text("".join(json.dumps({"a": 2, "b": 3, field: kind}) + "\n" for kind in kinds))
    batch, summary = run_agents(
        tmp_path, arithmetic_engine(tokenizer), environment, options | {"tasks": str(tasks)}, num_tasks=4, group_size=1
    )
    plan = {p.rollout_id: json.loads(p.task_json)[field] for p in batch.shard_plan(0)}
    receipts = {plan[rollout]: receipt for rollout, (receipt, _) in staged_manifests(batch).items()}
    assert receipts[answering].status == "ok" and receipts[answering].reward == 1.0
    expected = {"crash": crashed, "hang": "agent_timeout", "no_reward": "agent_no_reward"}
    for kind, reason in expected.items():
        assert (receipts[kind].status, receipts[kind].failure_reason) == ("failed", reason), kind
    assert "the agent's tool crashed" in json.loads(receipts["crash"].reward_info)["error"]
    assert f"timeout_s={options['timeout_s']}" in json.loads(receipts["hang"].reward_info)["error"]
    assert summary.ok == 1 and summary.failed == 3


def test_under_an_independent_message_graph_every_call_is_a_root_prompted_by_its_whole_history(
    tmp_path, tokenizer, tasks_file
):
    engine = arithmetic_engine(tokenizer)
    options = {"function": f"{AGENTS}:tool_agent", "tasks": str(tasks_file)}
    batch, summary = run_agents(tmp_path, engine, "agent_callable", options, message_graph="independent")
    assert summary.ok == 4
    assert batch.config.message_graph == "independent"
    for receipt, calls in staged_manifests(batch).values():
        assert [record.parent_call_id for record, _ in calls] == [None, None]
        assert [gateway_notes(delta).get("root_reason") for _, delta in calls] == [None, "independent"]
        second = calls[1][0]
        request = next(r for r in engine.requests if r.request_id == second.call_id)
        assert np.array_equal(calls[1][1].token_ids_delta[: len(request.prompt_token_ids)], request.prompt_token_ids)
        assert receipt.terminal_call_id == second.call_id and receipt.reward == 1.0
    finalize_batch(batch, FinalizeOptions(audit=False))
    rows = pq.read_table(batch.store.full_path(layout.dataset_part(0))).to_pylist()
    staged = sorted(staged_manifests(batch).items())
    calls = [(rollout, record.call_id) for rollout, (_, manifest) in staged for record, _ in manifest]
    assert [(row["rollout_id"], row["call_spans"][0]["call_id"]) for row in rows] == calls  # a row per call
    for rollout, group in itertools.groupby(rows, key=lambda row: row["rollout_id"]):
        assert len({(row["reward"], row["advantage"], row["sample_mask"]) for row in group}) == 1, rollout


def test_the_final_response_header_names_the_scored_call_and_must_agree_with_the_result(
    tmp_path, tokenizer, tasks_file
):
    options = {"function": f"{AGENTS}:header_declaring_agent", "tasks": str(tasks_file)}
    batch, summary = run_agents(tmp_path, arithmetic_engine(tokenizer), "agent_callable", options)
    plan = {p.rollout_id: json.loads(p.task_json)["a"] for p in batch.shard_plan(0)}
    outcomes = {}
    for rollout_id, (receipt, calls) in staged_manifests(batch).items():
        first = calls[0][0].call_id
        outcomes[plan[rollout_id] % 2] = outcomes.get(plan[rollout_id] % 2, set()) | {
            (receipt.status, receipt.terminal_call_id == first, receipt.failure_reason)
        }
    # header only: the first call is scored, not the last; header and result naming two calls: poisoned
    assert outcomes == {0: {("ok", True, None)}, 1: {("poisoned", False, "witness_disagreement")}}
    assert summary.ok == 2


def test_a_chat_template_that_renders_tools_gets_them_and_no_fallback(tmp_path, tokenizer, tasks_file):
    """A template that renders ``tools`` itself (the bundled one plus a tools block) is handed the request's tools."""
    renders_tools = copy.deepcopy(tokenizer)
    block = "{% if tools %}{{ '<|im_start|>system\\nTOOLS: ' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
    renders_tools.chat_template = block + tokenizer.chat_template
    engine = arithmetic_engine(renders_tools)
    options = {"function": f"{AGENTS}:tool_agent", "tasks": str(tasks_file)}
    batch, summary = run_agents(tmp_path, engine, "agent_callable", options)
    assert summary.ok == 4
    for receipt, calls in staged_manifests(batch).values():
        (first, _), (second, _) = calls
        request = next(r for r in engine.requests if r.request_id == first.call_id)
        prompt = renders_tools.decode(list(request.prompt_token_ids))
        assert 'TOOLS: [{"type": "function"' in prompt and "<tools>" not in prompt
        assert second.parent_call_id == first.call_id and receipt.reward == 1.0


def test_a_bug_in_an_agent_class_fails_its_rollouts_not_the_attempt(tmp_path, tokenizer, tasks_file):
    environment = f"{AGENTS}:BrokenAgent"
    batch, summary = run_agents(tmp_path, arithmetic_engine(tokenizer), environment, {"tasks": str(tasks_file)})
    assert (summary.rollouts, summary.failed) == (4, 4)
    for receipt, _ in staged_manifests(batch).values():
        assert (receipt.status, receipt.failure_reason) == ("failed", "agent_error")
        assert "KeyError" in json.loads(receipt.reward_info)["error"]


@pytest.mark.parametrize("agent", ["tool_agent", "retrying_agent", "sub_agent"])
def test_an_agent_whose_attempt_died_is_run_again_and_answered_from_its_committed_calls(
    agent, tmp_path, tokenizer, tasks_file
):
    """The retry re-runs each unfinished agent from its start: requests that repeat a committed call (same parent,
    same prompt tokens) get the same reply from the record, tool call ids included; only the rest reach the engine.
    The batch equals a clean run's."""
    options = {"function": f"{AGENTS}:{agent}", "tasks": str(tasks_file)}
    room = {"sampling": SamplingSettings(temperature=1.0, max_tokens=64)}  # no reply cut: the fake's text is its ids'
    clean_engine = arithmetic_engine(tokenizer)
    clean, _ = run_agents(tmp_path / "clean", clean_engine, "agent_callable", options, **room)
    total = len(clean_engine.requests)

    dying = arithmetic_engine(tokenizer)
    dying._fail = lambda request: EngineDeadError("engine core died") if len(dying.requests) > total // 2 else None
    with pytest.raises(EngineDeadError):
        run_agents(tmp_path / "resumed", dying, "agent_callable", options, **room)
    answered = len(dying.results)
    engine = arithmetic_engine(tokenizer)
    batch = Batch.open(str(tmp_path / "resumed" / "runs"), clean.config.batch_id)
    summary = generate_shard(batch, 0, engine=engine, run=asyncio.run, progress=False)

    assert summary.ok == 4 and summary.divergences == 0
    replayed = {call for r in LedgerReader(batch.store, 0).receipts for call in r.replayed_calls}
    adopted = sum(r.num_calls for r in LedgerReader(batch.store, 0).receipts if r.attempt == 0)
    assert len(engine.requests) == total - len(replayed) - adopted
    # Every answered call was committed but those in flight when the engine died; none is sampled again.
    assert answered - clean.config.max_in_flight <= len(replayed) + adopted <= answered
    assert replayed
    assert verified_sequences(batch.store, 0).keys() == verified_sequences(clean.store, 0).keys()
    for rollout, deltas in verified_sequences(batch.store, 0).items():
        assert linearized(deltas).tolist() == linearized(verified_sequences(clean.store, 0)[rollout]).tolist()


def test_a_resumed_concurrent_agent_samples_what_its_clean_run_did_whatever_order_its_calls_arrive_in(
    tmp_path, tokenizer, tasks_file, monkeypatch
):
    """Two sub-agents calling at once; the engine's reply follows each call's seed. After the engine died mid-way,
    the retry replays each rollout's committed calls while the first sub-agent is held back, so the second's calls
    arrive first: every seed derives from the call's prompt (not from when it arrived), so the live calls sample
    what the clean run sampled and the batch is token-identical to it."""
    options = {"function": f"{AGENTS}:concurrent_agent", "tasks": str(tasks_file)}
    room = {"sampling": SamplingSettings(temperature=1.0, max_tokens=64), "max_in_flight": 4, "max_turns": 8}

    def seeded(request) -> str:
        return f"It is {request.seed % 997}."

    def order(engine: FakeScriptedEngine) -> list[str]:
        return ["multiplier" in tokenizer.decode(list(r.prompt_token_ids)) for r in engine.requests]

    clean_engine = FakeScriptedEngine(tokenizer, reply=seeded)
    clean, clean_summary = run_agents(tmp_path / "clean", clean_engine, "agent_callable", options, **room)
    assert clean_summary.ok == 4
    total = len(clean_engine.requests)
    dying = FakeScriptedEngine(tokenizer, reply=seeded)
    dying._fail = lambda request: EngineDeadError("engine core died") if len(dying.requests) > total // 2 else None
    with pytest.raises(EngineDeadError):
        run_agents(tmp_path / "resumed", dying, "agent_callable", options, **room)

    from tests.generation import agents_for_tests

    monkeypatch.setattr(agents_for_tests, "FIRST_SUB_AGENT_DELAY_S", 0.2)
    engine = FakeScriptedEngine(tokenizer, reply=seeded)
    batch = Batch.open(str(tmp_path / "resumed" / "runs"), clean.config.batch_id)
    summary = generate_shard(batch, 0, engine=engine, run=asyncio.run, progress=False)

    assert summary.ok == 4 and summary.divergences == 0
    assert any(r.replayed_calls for r in LedgerReader(batch.store, 0).receipts)
    resumed_order = order(engine)
    assert resumed_order[: len(resumed_order) // 2].count(True) > resumed_order[: len(resumed_order) // 2].count(False)
    clean_rows = verified_sequences(clean.store, 0)
    for rollout, deltas in verified_sequences(batch.store, 0).items():
        assert linearized(deltas).tolist() == linearized(clean_rows[rollout]).tolist(), rollout
