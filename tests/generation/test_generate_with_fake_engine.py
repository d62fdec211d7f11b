"""The shard runner over a fake scripted engine (real tokenizer, real storage, real environments)."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.errors import EngineError
from tasks.generate import generate_shard, rollouts
from tasks.plan import plan_batch
from tasks.storage.claims import read_claims
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.sweep import sweep_orphans

from .chains import linearized, verified_sequences
from .configs import fake_model_config
from .fakes import FakeScriptedEngine, FatalEngineCrash, fail_staging_writes


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "runs")


def run_shard(root: str, config: BatchConfig, shard: int, engine, **kwargs):
    batch = Batch.open(root, config.batch_id)
    return generate_shard(batch, shard, engine=engine, run=asyncio.run, progress=False, **kwargs)


def test_generated_shard_commits_and_every_chain_is_token_exact(root, tokenizer):
    config = fake_model_config()
    plan_batch(Batch.open(root, config.batch_id), config)
    engine = FakeScriptedEngine(tokenizer)
    summary = run_shard(root, config, 0, engine)
    assert (summary.rollouts, summary.ok, summary.attempt, summary.already_committed) == (4, 4, 0, False)
    assert summary.calls == len(engine.requests) > 4  # guess_number: several turns per rollout
    store = Batch.open(root, config.batch_id).store
    chains = verified_sequences(store, 0)
    assert len(chains) == 4
    for rollout_id, deltas in chains.items():
        terminal = deltas[-1].call_id
        result = engine.results[terminal]
        request = next(r for r in engine.requests if r.request_id == terminal)
        exact = np.array([*request.prompt_token_ids, *result.token_ids])
        assert np.array_equal(linearized(deltas), exact), rollout_id
        for parent, child in itertools.pairwise(deltas):
            child_request = next(r for r in engine.requests if r.request_id == child.call_id)
            parent_request = next(r for r in engine.requests if r.request_id == parent.call_id)
            parent_tokens = [*parent_request.prompt_token_ids, *engine.results[parent.call_id].token_ids]
            assert list(child_request.prompt_token_ids[: len(parent_tokens)]) == parent_tokens


def test_receipts_name_the_declared_terminal_and_rewards(root, tokenizer):
    config = fake_model_config(environment="arithmetic", max_turns=1)
    plan_batch(Batch.open(root, config.batch_id), config)
    run_shard(root, config, 1, FakeScriptedEngine(tokenizer, reply=lambda request: "The answer is 7."))
    ledger = LedgerReader(Batch.open(root, config.batch_id).store, 1)
    for bundle in ledger.rollouts():
        receipt = bundle.receipt
        assert receipt.status == "ok"
        assert receipt.terminal_selection == "declared"
        assert receipt.terminal_call_id == bundle.manifest[-1].call_id
        assert receipt.reward in (0.0, 1.0)
        assert receipt.num_calls == 1


def test_generating_a_committed_shard_is_a_no_op(root, tokenizer):
    config = fake_model_config()
    plan_batch(Batch.open(root, config.batch_id), config)
    first = run_shard(root, config, 0, FakeScriptedEngine(tokenizer))
    engine = FakeScriptedEngine(tokenizer)
    again = run_shard(root, config, 0, engine)
    assert again.already_committed
    assert (again.attempt, again.ok, again.calls) == (first.attempt, first.ok, first.calls)
    assert engine.requests == []


def test_retry_adopts_receipted_rollouts_and_produces_no_duplicates(root, tokenizer, monkeypatch):
    monkeypatch.setattr(rollouts, "LEDGER_FLUSH_SECONDS", 0.0)
    config = fake_model_config(num_tasks=4, group_size=3, shards=1, max_in_flight=2)
    plan_batch(Batch.open(root, config.batch_id), config)
    store = Batch.open(root, config.batch_id).store
    calls = []

    def crash_late(request):
        calls.append(request.request_id)
        return FatalEngineCrash("process died") if len(calls) > 14 else None

    with pytest.raises(FatalEngineCrash):
        run_shard(root, config, 0, FakeScriptedEngine(tokenizer, fail=crash_late))
    assert [c.attempt for c in read_claims(store, 0)] == [0]
    engine = FakeScriptedEngine(tokenizer)
    summary = run_shard(root, config, 0, engine)
    assert summary.attempt == 1
    assert 0 < summary.adopted < 12
    assert summary.rollouts == 12
    rerun = {r.request_id.split(".")[0] for r in engine.requests}
    ledger = LedgerReader(store, 0)
    receipts = {r.rollout_id: r for r in ledger.receipts}
    assert len(receipts) == len(ledger.receipts) == 12
    adopted = {rid for rid, r in receipts.items() if r.attempt == 0}
    assert len(adopted) == summary.adopted
    assert adopted.isdisjoint(rerun)
    assert len(verified_sequences(store, 0)) == 12
    report = sweep_orphans(store, 0, dry_run=True)
    assert report.orphans == ()  # the runner already swept what the dead attempt left


def test_engine_errors_write_failure_rows_and_poison_the_rollout(root, tokenizer):
    config = fake_model_config(shards=1, max_turns=3)
    plan_batch(Batch.open(root, config.batch_id), config)

    def fail_second_calls(request):
        return EngineError("device lost") if request.request_id.endswith(".c001") else None

    run_shard(root, config, 0, FakeScriptedEngine(tokenizer, reply=lambda r: "0", fail=fail_second_calls))
    ledger = LedgerReader(Batch.open(root, config.batch_id).store, 0)
    for bundle in ledger.rollouts():
        assert bundle.receipt.status == "poisoned"
        assert bundle.receipt.failure_reason == "engine_error"
        assert [f.reason for f in bundle.failures] == ["engine_error"]
        assert bundle.failures[0].parent_call_id == bundle.manifest[0].call_id


def test_staging_failure_poisons_but_the_environment_still_gets_its_completion(root, tokenizer, monkeypatch):
    config = fake_model_config(shards=1, max_turns=2, environment="arithmetic")
    plan_batch(Batch.open(root, config.batch_id), config)
    fail_staging_writes(monkeypatch, "disk full")
    engine = FakeScriptedEngine(tokenizer, reply=lambda r: "The answer is 3.")
    summary = run_shard(root, config, 0, engine)
    assert summary.poisoned == summary.rollouts == 8
    ledger = LedgerReader(Batch.open(root, config.batch_id).store, 0)
    for bundle in ledger.rollouts():
        assert bundle.manifest == ()
        assert [f.reason for f in bundle.failures] == ["staging_failed"]
        assert "disk full" in bundle.failures[0].detail
        assert bundle.receipt.failure_reason == "staging_failed"
        assert bundle.receipt.reward in (0.0, 1.0)  # the episode still finished and was scored


def test_history_rewrite_is_a_named_failure_never_a_new_root(root, tokenizer):
    config = fake_model_config(environment="tests.generation.fakes:RewritingEnvironment", shards=1, num_tasks=2)
    plan_batch(Batch.open(root, config.batch_id), config)
    run_shard(root, config, 0, FakeScriptedEngine(tokenizer))
    ledger = LedgerReader(Batch.open(root, config.batch_id).store, 0)
    for bundle in ledger.rollouts():
        assert bundle.receipt.status == "poisoned"
        assert bundle.receipt.failure_reason == "history_diverged"
        assert len(bundle.manifest) == 2
        assert [c.parent_call_id is None for c in bundle.manifest] == [True, False]


def test_context_length_is_a_named_failure(root, tokenizer):
    config = fake_model_config(shards=1, max_turns=6)
    plan_batch(Batch.open(root, config.batch_id), config)
    run_shard(root, config, 0, FakeScriptedEngine(tokenizer, reply=lambda r: "0", max_model_len=120))
    ledger = LedgerReader(Batch.open(root, config.batch_id).store, 0)
    reasons = {b.receipt.failure_reason for b in ledger.rollouts()}
    assert reasons == {"context_length"}
