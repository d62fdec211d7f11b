"""Published datasets for the training-step tests: a tiny policy, an engine whose logprobs are that policy's, and
plan → generate → finalize → commit in one call.

The tiny policy is the bundled model's architecture shrunk (2 layers, hidden 64, random weights, the bundled
tokenizer): a step takes well under a second, so the exactly-once trial can kill and restart it many times.
:class:`TeacherForcedEngine` answers with the fake engine's scripted tokens but gives each the logprob a policy
assigns it (full vocabulary at the request's temperature, through :mod:`tasks.models.logprobs`): a dataset a
trainer of that policy starts at ratio 1 on, without a real sampler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.batch import Batch
from tasks.config import BatchConfig, ModelSpec
from tasks.engines.base import GenerationRequest, GenerationResult
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shard
from tasks.models.provenance import CHAT_TEMPLATE_FILE, TOKENIZER_FILE_NAMES, model_provenance
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tests.finalize.rollouts import commit_by_hand
from tests.generation.fakes import FakeScriptedEngine

TINY_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def tiny_model_folder(out: Path, *, seed: int = 0) -> Path:
    """A model folder of the bundled architecture shrunk to :data:`TINY_SHAPE`, random weights (seeded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference

    bundled = resolve_model_reference(BUNDLED_REFERENCE)
    config = AutoConfig.from_pretrained(bundled, local_files_only=True)
    for name, value in TINY_SHAPE.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in (*TOKENIZER_FILE_NAMES, CHAT_TEMPLATE_FILE, "generation_config.json"):
        if (bundled / name).is_file():
            shutil.copyfile(bundled / name, out / name)
    return out


class TeacherForcedEngine(FakeScriptedEngine):
    """The fake engine's scripted tokens, each with ``policy``'s logprob of it (a stand-in sampler of ``policy``);
    with ``masks=True`` a truncating request's logprobs are over the fake engine's scripted kept sets."""

    name = "teacher-forced"

    def __init__(self, tokenizer: Any, policy: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        self.policy = policy

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        import numpy as np
        import torch

        from tasks.models.logprobs import full_vocab_logprobs, kept_set_logprobs

        result = await super().generate(request)
        ids = [*result.prompt_token_ids, *result.token_ids]
        start, tokens, temperature = (
            len(result.prompt_token_ids),
            torch.tensor(result.token_ids),
            request.sampling.temperature,
        )
        with torch.no_grad():
            scoring = torch.arange(start - 1, len(ids) - 1)
            logits = self.policy(input_ids=torch.tensor([ids]), logits_to_keep=scoring).logits[0]
            if result.kept is None:
                logprobs = full_vocab_logprobs(logits, tokens, temperature)
            else:  # the scripted kept sets (masks=True): the policy renormalized over each
                logprobs = kept_set_logprobs(logits, tokens, temperature, result.kept.counts, result.kept.token_ids)
        return dataclasses.replace(result, logprobs=logprobs.numpy().astype(np.float32))


def published_batch(
    root: Path,
    batch_id: str,
    model_folder: Path,
    generator: Any,
    *,
    run: Callable[..., Any] = asyncio.run,
    weight_version: int = 0,
    **overrides: Any,
) -> str:
    """Plan, generate (one shard, on the engine ``generator``), finalize and commit a guess_number batch of
    ``model_folder``; its batch URL. ``overrides`` are batch config fields (``engine`` among them).

    The config records ``model_folder``'s provenance and ``weight_version``, so its rows name those weights.
    """
    fields = {
        "batch_id": batch_id,
        "environment": "guess_number",
        "environment_options": {"lo": 1, "hi": 4},
        "num_tasks": 3,
        "group_size": 2,
        "shards": 1,
        "model": ModelSpec(reference=str(model_folder), **model_provenance(model_folder)),
        "sampling": SamplingSettings(temperature=0.8, max_tokens=8),
        "max_turns": 2,
        "max_in_flight": 6,
        "weight_version": weight_version,
    } | overrides
    config = BatchConfig(**fields)
    plan_batch(Batch.open(str(root), batch_id), config)
    generate_shard(Batch.open(str(root), batch_id), 0, engine=generator, run=run, progress=False)
    batch = Batch.open(str(root), batch_id)
    staged = finalize_batch(batch, FinalizeOptions(audit=False))
    commit_by_hand(batch.store, staged.marker)
    return batch.store.url
