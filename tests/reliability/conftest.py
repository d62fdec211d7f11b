"""Reliability fixtures: one committed two-shard guess_number batch from the FAKE scripted engine.

Generated once per session (real tokenizer, real Parquet, real storage on local disk, no vLLM);
tests take private copies to damage.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from tasks.batch import Batch
from tasks.config import BatchConfig, ModelSpec
from tasks.generate import generate_shards
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tests.local_batch import LocalBatch


@pytest.fixture(scope="session", autouse=True)
def _gx_analytics_off() -> None:
    os.environ["GX_ANALYTICS_ENABLED"] = "False"


def reliability_config(**overrides: Any) -> BatchConfig:
    fields = {
        "batch_id": "b-reliability",
        "environment": "guess_number",
        "environment_options": {"lo": 1, "hi": 8},
        "num_tasks": 4,
        "group_size": 2,
        "shards": 2,
        "model": ModelSpec(reference="fake-model"),
        "sampling": SamplingSettings(temperature=1.0, max_tokens=16),
        "max_turns": 3,
        "max_in_flight": 4,
    } | overrides
    return BatchConfig(**fields)


def generate_all(root: str, config: BatchConfig, tokenizer: Any, storage_options: Any = None) -> None:
    """Plan and generate every shard with the fake scripted engine."""
    from tests.generation.fakes import FakeScriptedEngine

    plan_batch(Batch.open(root, config.batch_id, storage_options), config)
    engine = FakeScriptedEngine(tokenizer, reply=lambda request: str(request.seed % 8 + 1))
    generate_shards(
        Batch.open(root, config.batch_id, storage_options),
        range(config.shards),
        engine=engine,
        run=asyncio.run,
        progress=False,
    )


@pytest.fixture(scope="session")
def committed_batch(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> LocalBatch:
    """Both shards generated and committed (not finalized)."""
    root = tmp_path_factory.mktemp("reliability-committed")
    config = reliability_config()
    generate_all(str(root), config, tokenizer)
    return LocalBatch(root=root, config=config)
