"""Validation fixtures: one guess_number batch generated with the fake scripted engine, its finalized copy, and a
batch whose rollouts resumed after a killed attempt.

Both are built once per test session (real tokenizer, real storage, real finalize); tests take
private copies (:func:`tests.validate.batches.copy_batch`) to corrupt or validate.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from tasks.batch import Batch
from tasks.config import BatchConfig, ModelSpec
from tasks.finalize.stage import finalize_batch
from tasks.generate import generate_shards
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tests.local_batch import LocalBatch, copy_batch

from .batches import generate_killed_then_resumed

WEIGHT_VERSION = 2  # the batch's planned weight version: a call admitted below it can be forged


@pytest.fixture(scope="session", autouse=True)
def _gx_analytics_off() -> None:
    os.environ["GX_ANALYTICS_ENABLED"] = "False"


def validation_config(**overrides: Any) -> BatchConfig:
    """Two shards of three guess_number groups of three rollouts, several turns each."""
    fields = {
        "batch_id": "b-validate",
        "environment": "guess_number",
        "environment_options": {"lo": 1, "hi": 8},
        "num_tasks": 6,
        "group_size": 3,
        "shards": 2,
        "model": ModelSpec(reference="fake-model"),
        "sampling": SamplingSettings(temperature=1.0, max_tokens=16),
        "max_turns": 4,
        "max_in_flight": 9,
        "weight_version": WEIGHT_VERSION,
    } | overrides
    return BatchConfig(**fields)


@pytest.fixture(scope="session")
def generated_batch(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> LocalBatch:
    """Both shards generated and committed, not finalized."""
    from tests.generation.fakes import FakeScriptedEngine

    root = tmp_path_factory.mktemp("validate-generated")
    config = validation_config()
    plan_batch(Batch.open(str(root), config.batch_id), config)
    engine = FakeScriptedEngine(tokenizer, reply=lambda r: str(r.seed % 8 + 1), weight_version=WEIGHT_VERSION)
    generate_shards(Batch.open(str(root), config.batch_id), [0, 1], engine=engine, run=asyncio.run, progress=False)
    return LocalBatch(root=root, config=config)


@pytest.fixture(scope="session")
def finalized_batch(generated_batch: LocalBatch, tmp_path_factory: pytest.TempPathFactory) -> LocalBatch:
    """The generated batch, finalized: its dataset is staged (not validated, not published)."""
    batch = copy_batch(generated_batch, tmp_path_factory.mktemp("validate-finalized"))
    finalize_batch(batch.handle)
    return batch


@pytest.fixture(scope="session")
def resumed_batch(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> LocalBatch:
    """One shard committed by a second attempt that resumed the rollouts its killed first attempt left unfinished:
    their receipts name the calls they replayed (``replayed_calls``)."""
    root = tmp_path_factory.mktemp("validate-resumed")
    config = validation_config(batch_id="b-resumed", num_tasks=3, shards=1)
    batch = Batch.open(str(root), config.batch_id)
    plan_batch(batch, config)
    generate_killed_then_resumed(
        batch, 0, tokenizer, crash_after=12, reply=lambda r: str(r.seed % 8 + 1), weight_version=WEIGHT_VERSION
    )
    return LocalBatch(root=root, config=config)
