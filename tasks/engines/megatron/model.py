"""The megatron-core side of the Megatron engine: process groups, the GPT model of a Llama shape, sampling.

Imports megatron-core at module level: import this module only after
:func:`tasks.engines.megatron.availability.require_megatron` said it is installed. One process, one GPU:
the engine runs with tensor and pipeline parallel size 1 (a process group of one rank is
created when none exists; an existing larger one is refused, not joined).
"""

from __future__ import annotations

import socket
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.inference.sampling import TorchSampling
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from tasks.engines.megatron.kept import KeptRecorder
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
    """megatron's torch sampling, recording what each truncating row kept, with greedy logprobs as vLLM reports them.

    Draws exactly as megatron-core 0.19's ``TorchSampling.sample_kernel`` does (same buckets by
    ``(temperature, top_k, top_p)`` in the same order, ``filter_logits``, softmax, one
    ``torch.multinomial`` per bucket from the same generator, the argmax for top-k 1), written
    out here so the filtered tensor each truncating bucket draws from is at hand: its mask
    (``filtered != -inf``) is the bucket's kept sets, staged with :attr:`kept`
    (:class:`~tasks.engines.megatron.kept.KeptRecorder`) under each row's megatron request id.

    Logprobs (:meth:`log_probs_kernel`, ``processed_logprobs``) of the rows just sampled:
    ``log_softmax(logits / T)`` over the sampler's own kept set (the ids it dropped ``-inf``), in
    float32, so a sampled token's logprob is ``log(p / S)`` with ``S`` the mass of the very set it
    was drawn from (megatron filtered again, on float32 logits, where a bfloat16 sampler's
    boundary can differ). Greedy rows (the engine sends temperature 0 as top-k 1 at temperature
    1; megatron takes the argmax, and top-k 1 is never sent otherwise) get the token's log-softmax
    under the unfiltered distribution, which is what vLLM returns for greedy requests (megatron's
    own would be log 1 = 0). The kept ids are moved to the host after the logprob kernels are
    queued (:meth:`KeptRecorder.record`); the step backend records whatever is still staged after
    each step.
    """

    def __init__(self, rng: torch.Generator, vocab_size: int, kept: KeptRecorder | None = None) -> None:
        super().__init__(rng, vocab_size)
        self.kept = kept if kept is not None else KeptRecorder()
        self._step: _SampledStep | None = None

    def sample_kernel(
        self,
        logits: torch.Tensor,
        n: int,
        context: Any,
        *,
        no_top_k: bool,
        no_top_p: bool,
        gather_indices: torch.Tensor | None = None,
        token_to_request_index: torch.Tensor | None = None,
        output: torch.Tensor | None = None,
        eager: bool = False,
        cache_key: Any = None,
    ) -> torch.Tensor:
        self.kept.record()  # a step that asked no logprobs left its masks staged
        self._step = None
        if token_to_request_index is not None:  # speculative decoding: not used by this engine, nothing recorded
            return super().sample_kernel(
                logits,
                n,
                context,
                no_top_k=no_top_k,
                no_top_p=no_top_p,
                gather_indices=gather_indices,
                token_to_request_index=token_to_request_index,
                output=output,
            )
        buckets = _buckets(context)
        request_ids = context.request_ids[context.paused_request_count : context.total_request_count].tolist()
        if gather_indices is not None:
            logits = logits[gather_indices[:n], :]
        if output is None:
            output = torch.empty(n, device=logits.device, dtype=torch.int64)
        tokens, rows_drawn, masks = [], [], {}
        for (temperature, top_k, top_p), rows in buckets.items():
            index = torch.tensor(rows, device=logits.device, dtype=torch.long)
            if top_k == 1:
                sampled = torch.argmax(logits[index, :], dim=-1)
            else:
                filtered = TorchSampling.filter_logits(
                    logits[index, :], temperature, top_k, top_p, vocab_size=self._vocab_size
                )
                probabilities = filtered.softmax(dim=-1)
                sampled = torch.multinomial(probabilities, num_samples=1, generator=self._rng).view(-1)
                sampled = torch.clamp(sampled, min=0, max=self._vocab_size - 1)
                if top_k > 0 or top_p > 0.0:
                    kept = filtered != float("-inf")
                    masks[(temperature, top_k, top_p)] = kept
                    self.kept.stage([request_ids[row] for row in rows], kept)
            tokens.append(sampled)
            rows_drawn.append(index)
        output[torch.cat(rows_drawn)] = torch.cat(tokens)
        self._step = _SampledStep(rows=n, buckets=buckets, masks=masks)
        return output

    def log_probs_kernel(self, logits: torch.Tensor, context: Any, *, token_to_request_index: Any = None) -> Any:
        step, self._step = self._step, None
        if step is None or token_to_request_index is not None or logits.shape[0] != step.rows:
            log_probs = self._filtered_again(logits, context, token_to_request_index)
        else:
            buckets = _buckets(context)
            if buckets != step.buckets:
                raise RuntimeError("megatron asked logprobs of other rows than it just sampled")
            log_probs = torch.empty_like(logits)
            for (temperature, top_k, top_p), rows in buckets.items():
                index = torch.tensor(rows, device=logits.device, dtype=torch.long)
                scaled = logits[index].float()
                if top_k != 1 and temperature != 1.0:
                    scaled = scaled / temperature
                kept = step.masks.get((temperature, top_k, top_p))
                if kept is not None:
                    scaled = scaled.masked_fill(~kept, float("-inf"))
                log_probs[index] = torch.log_softmax(scaled, dim=-1).to(log_probs.dtype)
        self.kept.record()
        return log_probs

    def _filtered_again(self, logits: torch.Tensor, context: Any, token_to_request_index: Any) -> Any:
        """megatron's own processed logprobs (it filters again), greedy rows raw: rows not just sampled here."""
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


@dataclass(frozen=True)
class _SampledStep:
    """What :meth:`VllmConventionSampling.sample_kernel` drew from in the step in progress."""

    rows: int
    buckets: dict[tuple[float, int, float], list[int]]
    masks: dict[tuple[float, int, float], torch.Tensor]  # the kept mask of each truncating bucket


def _buckets(context: Any) -> dict[tuple[float, int, float], list[int]]:
    """The active rows by ``(temperature, top_k, top_p)``, in first-seen order, as megatron's sampler groups them."""
    active = context.total_request_count - context.paused_request_count
    metadata = context.active_request_metadata
    keys = zip(
        metadata["temperature"][:active].tolist(),
        metadata["top_k"][:active].tolist(),
        metadata["top_p"][:active].tolist(),
        strict=True,
    )
    buckets: dict[tuple[float, int, float], list[int]] = defaultdict(list)
    for row, key in enumerate(keys):
        buckets[key].append(row)
    return dict(buckets)
