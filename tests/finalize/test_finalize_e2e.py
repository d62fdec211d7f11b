"""Finalizing shards the REAL engine generated, through both validation suites and publish: the
dataset loads with `datasets` and the collator, and every trainable row's input_ids are the
engine's exact prompt + completion tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.batch import Batch
from tasks.config import BatchConfig, EngineSpec, ModelSpec
from tasks.engines.base import Engine, GenerationRequest, GenerationResult
from tasks.errors import UncommittedShardsError
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shard
from tasks.models.provenance import model_provenance
from tasks.pipeline import finalize_and_publish
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tasks.trainer.collate import GrpoCollator, PublishedDataset
from tests.generation.fakes import DelegatingEngine

pytestmark = pytest.mark.e2e


class RecordingEngine(DelegatingEngine):
    """Delegates to the real engine and keeps every request and result (what the model really saw)."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner)
        self.seen: dict[str, tuple[GenerationRequest, GenerationResult]] = {}

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self.inner.generate(request)
        self.seen[request.request_id] = (request, result)
        return result


def test_finalized_real_shards_load_and_are_token_exact(vllm_engine, tmp_path):
    engine, loop = vllm_engine
    recording = RecordingEngine(engine)
    config = BatchConfig(
        batch_id="b-finalize-e2e",
        environment="guess_number",
        environment_options={"lo": 1, "hi": 6},
        num_tasks=3,
        group_size=2,
        shards=2,
        model=ModelSpec(reference=str(engine.model_path), **model_provenance(engine.model_path)),
        engine=EngineSpec(name="vllm", options={"max_model_len": 2048}),
        sampling=SamplingSettings(temperature=0.9, max_tokens=24),
        max_turns=3,
    )
    root = str(tmp_path / "runs")
    plan_batch(Batch.open(root, config.batch_id), config)
    generate_shard(Batch.open(root, config.batch_id), 0, engine=recording, run=loop.run, progress=False)
    with pytest.raises(UncommittedShardsError, match=r"shard\(s\) \[1\]"):
        finalize_batch(Batch.open(root, config.batch_id))
    generate_shard(Batch.open(root, config.batch_id), 1, engine=recording, run=loop.run, progress=False)

    result = finalize_and_publish(Batch.open(root, config.batch_id), FinalizeOptions(audit=True, audit_sample_size=4))
    assert {suite: outcome.status for suite, outcome in result.suites.items()} == {
        "lineage": "passed",
        "dataset": "passed",
    }
    published = result.published
    assert published is not None and published.created and published.marker.rows == 6
    assert published.marker.validation["dataset"]["status"] == "passed"
    store = Batch.open(root, config.batch_id).store
    assert store.exists("reports/index.html")
    assert all(store.exists(outcome.summary.report) for outcome in result.suites.values())  # both Data Docs
    again = finalize_and_publish(Batch.open(root, config.batch_id))
    assert again.published is not None and not again.published.created
    assert again.published.marker == published.marker

    data = PublishedDataset.from_url(published.url)
    trainable = [data[i] for i in range(len(data)) if int(data[i]["sample_mask"]) == 1]
    assert trainable, "no trainable row to check"
    for row in trainable:
        terminal = max(c for c in recording.seen if c.startswith(row["rollout_id"] + "."))
        request, result = recording.seen[terminal]
        exact = np.array([*request.prompt_token_ids, *result.token_ids])
        np.testing.assert_array_equal(row["input_ids"].numpy(), exact)
        sampled = row["loss_mask"].numpy().astype(bool)
        np.testing.assert_allclose(row["logprobs"].numpy()[sampled][-len(result.token_ids) :], result.logprobs)

    datasets = pytest.importorskip("datasets")
    parts = [f"{published.url}/{p.path}" for p in published.marker.parts]
    loaded = datasets.load_dataset("parquet", data_files=parts, split="train")
    assert len(loaded) == 6
    batch = GrpoCollator(pad_token_id=engine.tokenizer.pad_token_id or 0)([loaded[i] for i in range(len(loaded))])
    assert batch["input_ids"].shape == batch["loss_mask"].shape == batch["advantages"].shape
    assert batch["input_ids"].dtype == torch.long
