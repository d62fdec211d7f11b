"""Batch configs the generate tests plan: on a fake model (fake engines) or on the bundled model (real vLLM)."""

from __future__ import annotations

from typing import Any

from tasks.config import BatchConfig, EngineSpec, ModelSpec
from tasks.models.provenance import model_provenance
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
from tasks.sampling import SamplingSettings


def fake_model_config(**overrides: Any) -> BatchConfig:
    """A small guess_number batch whose model is a name only (for fake engines)."""
    fields = {
        "batch_id": "b-fake",
        "environment": "guess_number",
        "num_tasks": 4,
        "group_size": 2,
        "shards": 2,
        "model": ModelSpec(reference="fake-model"),
        "sampling": SamplingSettings(temperature=1.0, max_tokens=16),
        "max_turns": 4,
        "max_in_flight": 3,
    } | overrides
    return BatchConfig(**fields)


def bundled_model_config(**overrides: Any) -> BatchConfig:
    """A small guess_number batch on the bundled model, with its recorded provenance (for the real engine)."""
    folder = resolve_model_reference(BUNDLED_REFERENCE)
    return fake_model_config(
        **{
            "batch_id": "b-e2e",
            "environment_options": {"lo": 1, "hi": 8},
            "num_tasks": 3,
            "shards": 1,
            "model": ModelSpec(reference=BUNDLED_REFERENCE, **model_provenance(folder)),
            "engine": EngineSpec(name="vllm", options={"max_model_len": 2048}),
            "sampling": SamplingSettings(temperature=0.8, max_tokens=24),
            "max_in_flight": 6,
        }
        | overrides
    )
