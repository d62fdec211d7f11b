"""The Megatron engine's options (``engine.options`` of a batch config for ``engine: megatron``).

Light on purpose (pydantic and the standard library only): the engine registry imports it to
check options at plan time, on machines without megatron-core or a GPU.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from tasks.engines.options import EngineOptions

# InferenceConfig fields the engine decides; inference_kwargs may not override them.
RESERVED_INFERENCE_KWARGS = frozenset(
    {"max_sequence_length", "max_requests", "buffer_size_gb", "logprobs_mode", "materialize_only_last_token_logits"}
)


class MegatronOptions(EngineOptions):
    """Options of ``engine: megatron``.

    ``max_model_len`` defaults to the model's context length; ``max_requests`` is how many requests
    the dynamic batch holds at once (more wait in its queue); ``kv_cache_gb`` is the GPU memory
    reserved for the KV cache; ``seed`` seeds the engine's sampling generator. ``inference_kwargs``
    passes any other ``megatron.core.inference.config.InferenceConfig`` field through unchanged.
    """

    engine = "megatron"
    unknown_hint = "other InferenceConfig fields go in inference_kwargs"

    dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="Weights dtype (parity runs use float32).")
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt + generation in tokens; default the model's context length."
    )
    max_requests: int = Field(256, ge=1, description="Requests in the dynamic batch at once (more wait in its queue).")
    kv_cache_gb: float = Field(8.0, gt=0, allow_inf_nan=False, description="GPU memory reserved for the KV cache.")
    seed: int = Field(0, ge=0, description="Seed of the engine's one sampling generator.")
    inference_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Other megatron InferenceConfig fields, passed through unchanged."
    )

    @field_validator("inference_kwargs")
    @classmethod
    def _no_fixed_fields(cls, inference_kwargs: dict[str, Any]) -> dict[str, Any]:
        for key in inference_kwargs:
            if key in RESERVED_INFERENCE_KWARGS:
                raise ValueError(f"inference_kwargs.{key}: fixed by the megatron engine (an engine option sets it)")
        return inference_kwargs
