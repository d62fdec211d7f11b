"""The megatron objects one engine owns, and their start on cuda:0.

Imports megatron-core only inside :func:`start_runtime`, which the engine calls after
:func:`~tasks.engines.megatron.availability.require_megatron` and
:func:`~tasks.engines.megatron.availability.require_gpu`. Invariants: the model holds the folder's
weights before the dynamic engine exists, and the controller samples and reports ``processed_logprobs``
through :class:`tasks.engines.megatron.model.VllmConventionSampling` (greedy rows as vLLM), which
files each truncating row's kept set in the runtime's :class:`~tasks.engines.megatron.kept.KeptRecorder`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.engines.megatron.kept import KeptRecorder
from tasks.engines.megatron.options import MegatronOptions
from tasks.engines.megatron.tokenizer import MegatronTokenizer
from tasks.engines.megatron.weights import LlamaShape, load_megatron_state


@dataclass(frozen=True)
class Runtime:
    """The megatron objects one engine owns: the GPT model, the dynamic engine over it, the model's dtype, and
    where its sampler files the kept sets of truncating rows."""

    model: Any
    engine: Any
    dtype: Any
    kept: KeptRecorder


class ClosedRuntime:
    """Stands in for the runtime after the engine closed: no model, no requests."""

    engine = None


def start_runtime(
    path: Path, shape: LlamaShape, options: MegatronOptions, max_model_len: int, tokenizer: Any
) -> Runtime:
    """Process groups, the GPT model with the folder's weights, and a dynamic engine over it (on cuda:0)."""
    import torch
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from tasks.engines.megatron import model as megatron_model

    torch.cuda.set_device(0)
    megatron_model.ensure_single_rank_groups(seed=options.seed)
    dtype = getattr(torch, options.dtype)
    model = megatron_model.build_gpt_model(shape, dtype, torch.device("cuda"), sampling_seed=options.seed)
    megatron_model.load_weights(model, load_megatron_state(path, shape, dtype))
    config = InferenceConfig(
        **{
            "max_sequence_length": max_model_len,
            "max_requests": options.max_requests,
            "buffer_size_gb": options.kv_cache_gb,
            "logprobs_mode": "processed_logprobs",
            "materialize_only_last_token_logits": True,
        }
        | options.inference_kwargs
    )
    context = DynamicInferenceContext(model.config, config)
    controller = TextGenerationController(
        inference_wrapped_model=GPTInferenceWrapper(model, context), tokenizer=MegatronTokenizer(tokenizer)
    )
    kept = KeptRecorder()
    controller._sampling = megatron_model.VllmConventionSampling(controller.sampling_rng, controller.vocab_size, kept)
    engine = DynamicInferenceEngine(controller=controller, context=context)
    return Runtime(model=model, engine=engine, dtype=dtype, kept=kept)
