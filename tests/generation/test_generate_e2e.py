"""The generate stage over the REAL vLLM engine (shared session engine) on the bundled model.

Multi-turn ``guess_number`` and ``calculator`` rollouts, on local disk and on S3 (moto server):
every child prompt starts with its parent's exact tokens, staged digests and chains recompute,
a retry adopts finished rollouts and resumes the rest token-identically to a clean run (no
committed call sampled twice), and an induced staging failure yields failure rows and a
poisoned receipt.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tasks.batch import Batch
from tasks.engines.base import Engine, GenerationRequest, GenerationResult
from tasks.generate import generate_shard
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.objects import ObjectStore
from tasks.storage.recovery import recover_earlier_attempts

from .chains import linearized, verified_sequences
from .configs import bundled_model_config
from .fakes import DelegatingEngine, FatalEngineCrash, fail_staging_writes

pytestmark = pytest.mark.e2e


class CrashingEngine(DelegatingEngine):
    """Delegates to the real engine, then dies (a process crash) on the n-th request."""

    def __init__(self, inner: Engine, crash_at: int) -> None:
        super().__init__(inner)
        self.crash_at, self.calls = crash_at, 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.calls += 1
        if self.calls >= self.crash_at:
            raise FatalEngineCrash("worker died")
        return await self.inner.generate(request)


def multi_turn_chains_are_exact(store, engine) -> int:
    """Check every ok rollout's chain; return how many child calls were checked."""
    chains = verified_sequences(store, 0)
    assert chains, "no ok rollout to check"
    children = 0
    for deltas in chains.values():
        sequence = linearized(deltas)
        for depth in range(1, len(deltas)):
            parent, child = deltas[depth - 1], deltas[depth]
            # the child's prompt = parent's exact tokens (prompt + sampled ids) + its own carried turn
            assert child.prev_len == parent.cum_len
            assert np.array_equal(sequence[: child.prev_len], linearized(deltas[:depth]))
            sampled = parent.token_ids_delta[parent.token_mask_delta == 1.0]
            assert sampled[-1] == engine.eos_token_id or parent.finish_reason == "length"
            children += 1
    return children


def test_calculator_on_s3_with_the_real_engine(vllm_engine, s3_bucket):
    engine, loop = vllm_engine
    config = bundled_model_config(
        batch_id="b-e2e-calc",
        environment="calculator",
        environment_options={},
        num_tasks=2,
        group_size=2,
        max_turns=3,
        sampling=SamplingSettings(max_tokens=32),
    )
    root = f"{s3_bucket}/runs"
    plan_batch(Batch.open(root, config.batch_id), config)
    summary = generate_shard(Batch.open(root, config.batch_id), 0, engine=engine, run=loop.run, progress=False)
    assert summary.rollouts == 4
    store = ObjectStore(root).child(f"batches/{config.batch_id}")
    assert store.is_s3
    ledger = LedgerReader(store, 0)
    assert len(ledger.receipts) == 4
    assert all(r.status in ("ok", "poisoned") for r in ledger.receipts)
    verified_sequences(store, 0)


def test_a_retry_adopts_finished_rollouts_and_resumes_the_rest_as_a_clean_run_samples_them(vllm_engine, tmp_path):
    """In-process vLLM: the killed attempt's receipted rollouts are adopted, the others replay their committed calls
    and go on live; no committed call is sampled again, and the batch is token-identical to a clean run.

    The clean run is also the guess_number batch on local disk with the real engine: several turns per rollout, every
    child prompt its parent's exact tokens plus its own turn, each ok rollout's terminal call the one it declared."""
    engine, loop = vllm_engine
    config = bundled_model_config(
        batch_id="b-e2e-retry",
        environment_options={"lo": 1, "hi": 1000},  # rarely guessed: rollouts run several turns
        num_tasks=4,
        group_size=2,
        max_in_flight=4,
        max_turns=3,
    )
    clean = dataclasses.replace(config, batch_id="b-e2e-retry-clean")
    root = str(tmp_path / "runs")
    for planned in (config, clean):
        plan_batch(Batch.open(root, planned.batch_id), planned)
    counted = CrashingEngine(engine, crash_at=10**9)
    ran = generate_shard(Batch.open(root, clean.batch_id), 0, engine=counted, run=loop.run, progress=False)
    assert ran.rollouts == 8 and ran.ok + ran.poisoned == 8
    assert ran.calls > 8, "guess_number should take several turns"
    clean_store = Batch.open(root, clean.batch_id).store
    assert multi_turn_chains_are_exact(clean_store, engine) > 0
    assert {r.terminal_selection for r in LedgerReader(clean_store, 0).receipts if r.status == "ok"} == {"declared"}
    with pytest.raises(FatalEngineCrash):
        generate_shard(
            Batch.open(root, config.batch_id),
            0,
            engine=CrashingEngine(engine, crash_at=18),  # after about four rollouts' three calls each
            run=loop.run,
            progress=False,
        )
    store = Batch.open(root, config.batch_id).store
    left = recover_earlier_attempts(store, 0, attempt=1)
    committed = sum(len(b.manifest) for b in left.rollouts) + sum(len(c) for c in left.unreceipted.values())
    retried = CrashingEngine(engine, crash_at=10**9)
    summary = generate_shard(Batch.open(root, config.batch_id), 0, engine=retried, run=loop.run, progress=False)
    assert summary.attempt == 1 and 0 < summary.adopted < 8 and summary.replayed_calls > 0
    assert retried.calls == counted.calls - committed  # nothing committed was sampled again
    ledger = LedgerReader(store, 0)
    ids = [r.rollout_id for r in ledger.receipts]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 8
    resumed = verified_sequences(store, 0)
    reference = verified_sequences(clean_store, 0)
    assert resumed.keys() == reference.keys() and len(resumed) == summary.ok
    for rollout, deltas in resumed.items():
        assert linearized(deltas).tolist() == linearized(reference[rollout]).tolist(), rollout


def test_induced_staging_failure_yields_failure_rows_and_a_poisoned_receipt(vllm_engine, tmp_path, monkeypatch):
    engine, loop = vllm_engine
    config = bundled_model_config(batch_id="b-e2e-fail", num_tasks=1, group_size=2, max_turns=2)
    root = str(tmp_path / "runs")
    plan_batch(Batch.open(root, config.batch_id), config)
    fail_staging_writes(monkeypatch, "injected: staging bucket unavailable")
    summary = generate_shard(Batch.open(root, config.batch_id), 0, engine=engine, run=loop.run, progress=False)
    assert summary.poisoned == 2
    ledger = LedgerReader(Batch.open(root, config.batch_id).store, 0)
    for bundle in ledger.rollouts():
        assert bundle.receipt.status == "poisoned"
        assert bundle.receipt.failure_reason == "staging_failed"
        assert bundle.failures and {f.reason for f in bundle.failures} == {"staging_failed"}
        assert "injected" in bundle.failures[0].detail


class RefitMidShard(DelegatingEngine):
    """The real engine, refitted (same weights, next version) as the n-th request arrives, others in flight."""

    def __init__(self, inner: Engine, refit_at: int, version: int) -> None:
        super().__init__(inner)
        self.refit_at, self.version, self.calls = refit_at, version, 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.calls += 1
        if self.calls == self.refit_at:
            await self.inner.update_weights(str(self.inner.model_path), version=self.version)
        return await self.inner.generate(request)


def test_weight_versions_from_the_plan_and_a_refit_inside_a_real_shard_reach_the_dataset(vllm_engine, tmp_path):
    from tasks.finalize.stage import FinalizeOptions, finalize_batch

    engine, loop = vllm_engine
    planned = max(7, engine.weight_version + 1)
    loop.run(engine.update_weights(str(engine.model_path), version=planned), timeout=300)
    config = bundled_model_config(
        batch_id="b-e2e-versions", weight_version=planned, num_tasks=4, group_size=2, max_in_flight=8
    )
    root = str(tmp_path / "runs")
    plan_batch(Batch.open(root, config.batch_id), config)
    refitting = RefitMidShard(engine, refit_at=10, version=planned + 1)
    summary = generate_shard(Batch.open(root, config.batch_id), 0, engine=refitting, run=loop.run, progress=False)
    assert refitting.calls >= 10, "the shard ended before the refit"
    calls = LedgerReader(Batch.open(root, config.batch_id).store, 0).calls
    assert {c.weight_version for c in calls} == {planned, planned + 1}
    spanning = [c for c in calls if c.epoch_span]
    assert spanning and {c.weight_version for c in spanning} == {planned}

    published = finalize_batch(Batch.open(root, config.batch_id), FinalizeOptions(audit=False))
    store = Batch.open(root, config.batch_id).store
    metrics = json.loads(store.read_bytes("dataset/metrics.json"))
    assert metrics["epoch_span_count"] == len(spanning) == sum(c.epoch_span for c in calls)
    rows = [row for part in published.marker.parts for row in read_part(store, part.path)]
    assert len(rows) == summary.rollouts
    for row in rows:
        if row["sample_mask"]:
            versions = {span["weight_version"] for span in row["weight_version_spans"]}
            assert (row["weight_version_min"], row["weight_version_max"]) == (min(versions), max(versions))
            assert versions <= {planned, planned + 1}
    assert any(r["weight_version_max"] == planned + 1 for r in rows if r["sample_mask"])
    assert any(r["weight_version_min"] == planned for r in rows if r["sample_mask"])


def read_part(store: ObjectStore, path: str) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(store.read_bytes(path))).to_pylist()
