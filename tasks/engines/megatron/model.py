"""The megatron-core side of the Megatron engine: process groups, the GPT model of a Llama shape, sampling.

Imports megatron-core at module level: import this module only after
:func:`tasks.engines.megatron.availability.require_megatron` said it is installed. One process, one GPU:
the engine runs with tensor and pipeline parallel size 1 (a process group of one rank is
created when none exists; an existing larger one is refused, not joined).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.inference.sampling import TorchSampling
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from tasks.engines.megatron.weights import LlamaShape, WeightMappingError

# Tensors megatron modules keep besides weights (serialization state of fused modules), never loaded.
EXTRA_STATE_SUFFIX = "._extra_state"


def ensure_single_rank_groups(*, seed: int) -> None:
    """A one-rank process group (NCCL, loopback), megatron's model-parallel groups of size 1 and its RNG tracker."""
    if not dist.is_initialized():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(
            f"torch.distributed already runs {dist.get_world_size()} ranks; the Megatron engine runs on one rank"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(shape: LlamaShape, dtype: torch.dtype, *, sampling_seed: int) -> TransformerConfig:
    """A Llama decoder in megatron terms: RMSNorm, SwiGLU, grouped-query attention, no biases, no dropout."""
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        perform_initialization=False,
        use_cpu_initialization=True,
        inference_sampling_seed=sampling_seed,
    )


def build_gpt_model(shape: LlamaShape, dtype: torch.dtype, device: torch.device, *, sampling_seed: int) -> GPTModel:
    """An uninitialised megatron GPT model of ``shape`` on ``device``, in eval mode (load weights next)."""
    model = GPTModel(
        config=transformer_config(shape, dtype, sampling_seed=sampling_seed),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=shape.rope_theta,
    )
    return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def load_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model``'s parameters in place (same tensors: the engine keeps its references).

    Every parameter must be in ``state`` with its exact shape and ``state`` must hold nothing else.
    """
    params = {name: tensor for name, tensor in model.state_dict(keep_vars=True).items()}
    params = {name: tensor for name, tensor in params.items() if not name.endswith(EXTRA_STATE_SUFFIX)}
    if shared := _shared_output_name(model, params):
        params.pop(shared)
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise WeightMappingError(f"megatron model and mapped weights differ: missing {missing}, extra {unexpected}")
    for name, tensor in state.items():
        target = params[name]
        if target.shape != tensor.shape:
            raise WeightMappingError(f"{name}: mapped shape {tuple(tensor.shape)}, model has {tuple(target.shape)}")
        target.copy_(tensor, non_blocking=True)


def _shared_output_name(model: torch.nn.Module, params: Mapping[str, Any]) -> str | None:
    """With tied embeddings megatron may list ``output_layer.weight`` too: it is the embedding, not loaded twice."""
    if getattr(model, "share_embeddings_and_output_weights", False) and "output_layer.weight" in params:
        return "output_layer.weight"
    return None


class VllmConventionSampling(TorchSampling):
    """megatron's torch sampling, with greedy rows' logprobs taken the way vLLM reports them.

    The engine sends a greedy request as top-k 1 at temperature 1 (megatron takes the argmax;
    top-k 1 is never sent otherwise). Its recorded logprob is the token's log-softmax under the
    unfiltered distribution, which is what vLLM returns for greedy requests in
    ``processed_logprobs`` mode (megatron's own would be log 1 = 0); every other row keeps
    megatron's processed logprob.
    """

    def log_probs_kernel(self, logits: torch.Tensor, context: Any, *, token_to_request_index: Any = None) -> Any:
        active = context.total_request_count - context.paused_request_count
        top_k = context.active_request_metadata["top_k"][:active]
        if token_to_request_index is not None:
            top_k = top_k[token_to_request_index]
        greedy = (top_k == 1).to(logits.device)
        if not bool(greedy.any()):
            return super().log_probs_kernel(logits, context, token_to_request_index=token_to_request_index)
        raw = torch.log_softmax(logits.float(), dim=-1)
        if bool(greedy.all()):
            return raw
        processed = super().log_probs_kernel(logits, context, token_to_request_index=token_to_request_index)
        return torch.where(greedy[:, None], raw, processed)
