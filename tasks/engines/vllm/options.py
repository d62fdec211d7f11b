"""The vLLM engine's options (``engine.options`` of a batch config): the ``AsyncEngineArgs`` and vLLM-CPU environment.

Light on purpose (pydantic and the standard library only): the engine registry imports it to
check options at plan time and to describe them in the Airflow form. ``rollout-ledger serve``
starts vLLM's server with the same options (:mod:`tasks.engines.vllm_server.serving.launch`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from tasks.engines.options import DEFAULT_MASK_CANDIDATES, MAX_MASK_CANDIDATES, EngineOptions

LOGPROBS_MODE = "processed_logprobs"
# vLLM-CPU runs whole prefills (see engine_args): a batch holds at least this many tokens.
CPU_MIN_BATCHED_TOKENS = 2048
# vLLM-CPU settings applied only where the user has not set them (CPU platform only).
CPU_KVCACHE_GIB = "1"
# Engine arguments this module decides; engine_kwargs may not override them.
RESERVED_ENGINE_KWARGS = frozenset({"model", "tokenizer", "logprobs_mode", "skip_tokenizer_init", "max_logprobs"})


class VllmOptions(EngineOptions):
    """Options of ``engine: vllm``; ``None`` means the platform default.

    ``dtype`` defaults to float32 on CPU (deterministic across batch sizes) and ``auto`` on
    GPU; ``enforce_eager`` to True on CPU (compilation costs minutes there). ``engine_kwargs``
    passes any other ``AsyncEngineArgs`` field through unchanged (``return_sampling_mask``, on GPU with
    Model Runner V2, makes vLLM return the kept sets itself: no top logprobs are read then).
    """

    engine = "vllm"
    unknown_hint = "others go in engine_kwargs"

    dtype: str | None = Field(None, description="Weights and activations dtype; default float32 on CPU, auto on GPU.")
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt + generation in tokens; default the model's context length."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs (or CPU ranks) one model replica is split over.")
    data_parallel_size: int = Field(1, ge=1, description="Replicas of the model serving the batch together.")
    enforce_eager: bool | None = Field(
        None, description="Skip graph compilation; default true on CPU (compiling costs minutes there)."
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Share of GPU memory vLLM may use; default vLLM's."
    )
    seed: int = Field(0, description="vLLM's engine seed (each request also carries its own seed).")
    sampling_mask_candidates: int = Field(
        DEFAULT_MASK_CANDIDATES,
        ge=2,
        le=MAX_MASK_CANDIDATES,
        description="Top logprobs read per token of a top-p / top-k call to record the ids its sampler kept; a "
        "token that kept this many or more fails its call (sampling_mask_overflow). Also vLLM's max_logprobs.",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Other AsyncEngineArgs fields, passed through unchanged."
    )

    @field_validator("engine_kwargs")
    @classmethod
    def _no_named_or_contract_arguments(cls, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
        for key in engine_kwargs:
            if key in cls.model_fields and key != "engine_kwargs":
                raise ValueError(f"engine_kwargs.{key}: set it as the engine option {key!r} instead")
            if key in RESERVED_ENGINE_KWARGS:
                raise ValueError(f"engine_kwargs.{key}: fixed by the vLLM engine (the data contract needs it)")
        return engine_kwargs

    def engine_args(self, model_path: Path, *, on_cpu: bool) -> dict[str, Any]:
        """Keyword arguments of ``AsyncEngineArgs`` for serving ``model_path``."""
        args: dict[str, Any] = {
            "model": str(model_path),
            "tokenizer": str(model_path),
            "dtype": self.dtype or ("float32" if on_cpu else "auto"),
            "tensor_parallel_size": self.tensor_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "enforce_eager": on_cpu if self.enforce_eager is None else self.enforce_eager,
            "seed": self.seed,
            "logprobs_mode": LOGPROBS_MODE,
            "max_logprobs": self.sampling_mask_candidates,
            "disable_log_stats": True,
        }
        if self.max_model_len is not None:
            args["max_model_len"] = self.max_model_len
        if self.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        if on_cpu and "enable_chunked_prefill" not in self.engine_kwargs:
            # vLLM-CPU 0.32 crashes the engine ("CPU Generator does not use offset") when a seeded
            # request's prefill is chunked: rewinding its sampler discards needs CUDA generators.
            # Per-request seeds are part of the contract, so prefills are scheduled whole on CPU.
            max_len = self.max_model_len or _model_max_len(model_path)
            args["enable_chunked_prefill"] = False
            args["max_num_batched_tokens"] = max(max_len, CPU_MIN_BATCHED_TOKENS)
        return args | self.engine_kwargs

    def cpu_env_defaults(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The vLLM-CPU environment settings to add: only those ``environ`` does not set.

        KV cache of 1 GiB (vLLM-CPU needs one); OpenMP threads bound to every CPU this process
        may use, for a single-rank engine (about 2x faster than vLLM's ``auto`` on small hosts).
        """
        defaults = {"VLLM_CPU_KVCACHE_SPACE": CPU_KVCACHE_GIB}
        if self.tensor_parallel_size * self.data_parallel_size == 1:
            defaults["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))
        return {key: value for key, value in defaults.items() if key not in environ}


def _model_max_len(model_path: Path) -> int:
    """The model's own context length (``max_position_embeddings`` of its config.json)."""
    config = json.loads((model_path / "config.json").read_text())
    value = config.get("max_position_embeddings") or config.get("max_seq_len") or config.get("n_positions")
    if not isinstance(value, int) or value < 2:
        raise ValueError(f"{model_path}/config.json names no context length; set the engine option max_model_len")
    return value
