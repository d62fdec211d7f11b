"""How a generate attempt begins and ends, over a fake scripted engine (real tokenizer, real storage).

Claims keep live writers apart, a lost marker race returns the winner's summary, the engine dying
ends the attempt without a marker and without poisoning anyone, weight versions come from the
plan, several shards share one engine, and a bad model is refused before any engine starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.config import BatchConfig, ModelSpec
from tasks.errors import ConfigError, EngineDeadError, ModelMismatchError
from tasks.generate import ShardSummary, generate_shard, generate_shards, rollouts
from tasks.models.provenance import WEIGHTS_DECLARED
from tasks.plan import plan_batch
from tasks.storage.claims import attempts_used, claim_attempt, read_claims
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.marker import read_marker
from tasks.storage.recovery import read_uncommitted_attempt

from .configs import fake_model_config
from .fakes import FakeScriptedEngine, FatalEngineCrash


def make_config(**overrides) -> BatchConfig:
    return fake_model_config(
        **{"batch_id": "b-life", "environment_options": {"lo": 1, "hi": 8}, "max_in_flight": 2} | overrides
    )


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "runs")


def run(root: str, config: BatchConfig, shards, engine, storage_options=None, **kwargs):
    batch = Batch.open(root, config.batch_id, storage_options)
    return generate_shards(batch, shards, engine=engine, run=asyncio.run, progress=False, **kwargs)


def test_each_attempt_claims_its_number_once_and_records_who_ran_it(root, tokenizer):
    config = make_config()
    plan_batch(Batch.open(root, config.batch_id), config)
    store = Batch.open(root, config.batch_id).store
    first = claim_attempt(store, batch_id=config.batch_id, shard=0, try_number=3, code_version="v-test")
    (summary,) = run(root, config, [0], FakeScriptedEngine(tokenizer), try_number=4)
    assert (first.attempt, summary.attempt) == (0, 1)
    claims = read_claims(store, 0)
    assert [(c.attempt, c.try_number) for c in claims] == [(0, 3), (1, 4)]
    assert claims[1].pid > 0 and claims[1].host and claims[1].code_version.startswith("rollout-ledger")
    assert attempts_used(store, 0) == {0, 1}


def test_racing_claimers_never_share_an_attempt(root, tokenizer):
    config = make_config()
    plan_batch(Batch.open(root, config.batch_id), config)
    store = Batch.open(root, config.batch_id).store
    claims, barrier = [], threading.Barrier(6)

    def claim() -> None:
        barrier.wait()
        claims.append(claim_attempt(store, batch_id=config.batch_id, shard=1).attempt)

    threads = [threading.Thread(target=claim) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(claims) == list(range(6))


def test_two_live_writers_of_a_shard_commit_once_and_the_loser_returns_the_winner(root, tokenizer):
    config = make_config(shards=1, num_tasks=3)
    plan_batch(Batch.open(root, config.batch_id), config)
    barrier = threading.Barrier(2)
    results: dict[str, object] = {}

    def writer(name: str) -> None:
        barrier.wait()
        try:
            results[name] = generate_shard(
                Batch.open(root, config.batch_id),
                0,
                engine=FakeScriptedEngine(tokenizer),
                run=asyncio.run,
                progress=False,
            )
        except BaseException as exc:  # surfaced below
            results[name] = exc

    threads = [threading.Thread(target=writer, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    summaries = sorted(results.values(), key=lambda s: s.already_committed)  # type: ignore[union-attr]
    winner, loser = summaries
    assert not winner.already_committed and loser.already_committed
    assert loser.attempt == winner.attempt
    store = Batch.open(root, config.batch_id).store
    marker = read_marker(store, 0)
    assert marker is not None and marker.attempt == winner.attempt
    receipts = LedgerReader(store, 0).receipts
    assert sorted(r.rollout_id for r in receipts) == sorted({r.rollout_id for r in receipts})
    assert len(receipts) == config.num_rollouts
    assert {c.attempt for c in read_claims(store, 0)} == {0, 1}


class DyingEngine(FakeScriptedEngine):
    """A fake engine whose process 'dies' at the n-th request: that and every later request raise EngineDeadError."""

    def __init__(self, tokenizer, *, dies_at: int) -> None:
        super().__init__(tokenizer, fail=self._fail_when_dead)
        self.dies_at, self.count = dies_at, 0

    def _fail_when_dead(self, request):
        self.count += 1
        return EngineDeadError("engine core died") if self.count >= self.dies_at else None


def test_engine_death_ends_the_attempt_without_a_marker_and_poisons_no_one(root, tokenizer, monkeypatch):
    monkeypatch.setattr(rollouts, "LEDGER_FLUSH_SECONDS", 3600.0)  # only the stop path flushes
    config = make_config(shards=1, num_tasks=6, group_size=2, max_in_flight=3)
    plan_batch(Batch.open(root, config.batch_id), config)
    store = Batch.open(root, config.batch_id).store
    with pytest.raises(EngineDeadError, match="engine core died"):
        run(root, config, [0], DyingEngine(tokenizer, dies_at=14))
    assert read_marker(store, 0) is None
    left = read_uncommitted_attempt(store, 0, 0)
    assert left.rollouts, "receipts of the rollouts that completed before the death were flushed"
    assert all(b.receipt.failure_reason != "engine_error" for b in left.rollouts)
    assert all(not b.failures for b in left.rollouts)
    (summary,) = run(root, config, [0], FakeScriptedEngine(tokenizer))
    assert (summary.attempt, summary.adopted, summary.rollouts) == (1, len(left.rollouts), 12)
    assert summary.poisoned == 0


def test_rows_carry_the_planned_weight_version_and_an_older_engine_is_refused(root, tokenizer):
    config = make_config(shards=1, weight_version=7)
    plan_batch(Batch.open(root, config.batch_id), config)
    with pytest.raises(ConfigError, match="weight version 6, older than the planned 7"):
        run(root, config, [0], FakeScriptedEngine(tokenizer, weight_version=6))
    run(root, config, [0], FakeScriptedEngine(tokenizer, weight_version=7))
    calls = LedgerReader(Batch.open(root, config.batch_id).store, 0).calls
    assert calls and {c.weight_version for c in calls} == {7}


def test_an_engine_whose_weights_are_only_declared_is_refused_when_the_plan_verified_them(root, tokenizer):
    config = make_config(shards=1)
    plan_batch(Batch.open(root, config.batch_id), config)
    declared = FakeScriptedEngine(tokenizer)
    declared.weights = WEIGHTS_DECLARED  # as a server engine whose model folder this worker cannot hash
    with pytest.raises(ModelMismatchError, match="the plan verified the served weights by their hashes"):
        run(root, config, [0], declared)


def test_a_refit_between_engine_steps_keeps_admission_versions_and_marks_spanning_calls(root, tokenizer):
    config = make_config(shards=1, num_tasks=4, group_size=2, max_in_flight=4, weight_version=3)
    plan_batch(Batch.open(root, config.batch_id), config)

    class RefittingEngine(FakeScriptedEngine):
        """Refits (version 3 -> 9) while its 6th request is in flight."""

        entered = 0

        async def generate(self, request):
            type(self).entered += 1
            if type(self).entered == 6:
                await self.update_weights("unused", version=9)
            return await super().generate(request)

    run(root, config, [0], RefittingEngine(tokenizer, weight_version=3))
    calls = LedgerReader(Batch.open(root, config.batch_id).store, 0).calls
    assert {c.weight_version for c in calls} == {3, 9}
    spanning = [c for c in calls if c.epoch_span]
    assert spanning and all(c.weight_version == 3 for c in spanning)


def test_several_shards_run_one_after_another_on_one_engine(root, tokenizer):
    config = make_config(shards=2)
    plan_batch(Batch.open(root, config.batch_id), config)
    engine = FakeScriptedEngine(tokenizer)
    first = run(root, config, [1], engine)
    summaries = run(root, config, [0, 1], engine)
    assert [s.shard for s in summaries] == [0, 1]
    assert (summaries[0].already_committed, summaries[1].already_committed) == (False, True)
    assert summaries[1].attempt == first[0].attempt
    assert summaries[0].signal is not None and summaries[0].signal.rollouts == 4


def test_a_model_whose_hashes_differ_from_the_plan_is_refused_before_any_engine_starts(root, monkeypatch):
    from tasks.models.provenance import model_provenance
    from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference

    planned = model_provenance(resolve_model_reference(BUNDLED_REFERENCE))
    config = make_config(
        shards=1,
        model=ModelSpec(reference=BUNDLED_REFERENCE, **(planned | {"weights_sha256": "ab" * 32})),
    )
    plan_batch(Batch.open(root, config.batch_id), config)

    async def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started for a model that does not match the plan")

    monkeypatch.setattr("tasks.engines.create_engine", no_engine)
    with pytest.raises(ModelMismatchError, match=r"weights_sha256: planned abababababab"):
        generate_shard(Batch.open(root, config.batch_id), 0, progress=False)


def _die(*args, **kwargs):
    raise FatalEngineCrash("the process died")


def test_a_retry_that_adopts_every_rollout_commits_without_starting_an_engine(root, tokenizer, monkeypatch):
    """A crash between the last receipt and the marker: the retry adopts everything, so no engine starts."""
    from tasks.models.provenance import model_provenance
    from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference

    planned = model_provenance(resolve_model_reference(BUNDLED_REFERENCE))
    config = make_config(shards=1, num_tasks=2, model=ModelSpec(reference=BUNDLED_REFERENCE, **planned))
    plan_batch(Batch.open(root, config.batch_id), config)
    store = Batch.open(root, config.batch_id).store
    with monkeypatch.context() as crashing:  # attempt 0 receipted every rollout; the process died writing its marker
        crashing.setattr("tasks.storage.ledger_writer.write_marker", _die)
        with pytest.raises(FatalEngineCrash):
            run(root, config, [0], FakeScriptedEngine(tokenizer))
    first = read_uncommitted_attempt(store, 0, 0)
    assert len(first.rollouts) == config.num_rollouts

    async def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started for a shard with nothing left to run")

    notices = []
    monkeypatch.setattr("tasks.engines.create_engine", no_engine)
    summary = generate_shard(Batch.open(root, config.batch_id), 0, progress=False, on_engine_start=notices.append)
    assert (summary.attempt, summary.adopted, summary.rollouts) == (1, len(first.rollouts), len(first.rollouts))
    assert (summary.generated_tokens, notices) == (0, [])
    marker = read_marker(store, 0)
    assert marker is not None and marker.attempt == 1
    assert {r.attempt for r in LedgerReader(store, 0).receipts} == {0}


def test_an_edited_prompt_file_is_refused_before_any_engine_starts(root, tmp_path, monkeypatch):
    from tasks.errors import EnvironmentLoadError

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say 1.", "ground_truth": "1"}\n{"prompt": "Say 2.", "ground_truth": "2"}\n')
    config = make_config(shards=1, num_tasks=2, environment=str(prompts), environment_options={})
    summary = plan_batch(Batch.open(root, config.batch_id), config)
    assert summary.config.environment == f"file://{prompts}"
    assert summary.config.environment_options["sha256"]
    prompts.write_text('{"prompt": "Say 3.", "ground_truth": "3"}\n{"prompt": "Say 2.", "ground_truth": "2"}\n')

    async def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started for a changed prompt file")

    monkeypatch.setattr("tasks.engines.create_engine", no_engine)
    with pytest.raises(EnvironmentLoadError, match="changed: sha256"):
        generate_shard(Batch.open(root, config.batch_id), 0, progress=False)


def test_the_claim_names_a_layout_path_inside_the_attempt_directory():
    assert layout.attempt_claim(3, 2) == "ledger/shard-00003/attempt-02/_CLAIM.json"
    assert layout.attempt_of(layout.attempt_claim(3, 2)) == 2
    assert dataclasses.is_dataclass(ShardSummary)


def test_plan_and_generate_reach_s3_through_storage_options_alone(s3_endpoint, s3_bucket, tokenizer, monkeypatch):
    from tasks.storage.options import AWS_REGION_VARIABLES, AWS_VARIABLES

    for variable in (*AWS_VARIABLES, *AWS_REGION_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing", "skip_instance_cache": True}
    root = f"{s3_bucket}/runs"
    config = make_config(shards=1, num_tasks=2)
    plan_batch(Batch.open(root, config.batch_id, options), config)
    (summary,) = run(root, config, [0], FakeScriptedEngine(tokenizer), storage_options=options)
    assert (summary.rollouts, summary.already_committed) == (4, False)
    store = Batch.open(root, config.batch_id, options).store
    assert store.is_s3 and read_marker(store, 0) is not None
    assert [c.attempt for c in read_claims(store, 0)] == [0]
