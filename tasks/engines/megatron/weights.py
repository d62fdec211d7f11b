"""Hugging Face Llama checkpoints as megatron-core GPT weights: the shape and the name/layout mapping.

Pure PyTorch (no megatron import), so the mapping is tested where megatron-core is not installed.
Invariants: every Hugging Face tensor of the checkpoint is used exactly once (an unknown or
missing one is an error naming it, never silently dropped or zero-filled), and the megatron
layout is the one megatron-core's local GPT layer spec reads:

* ``linear_qkv``: per query group ``g``, the group's query heads, then its key head, then its
  value head (``[q_g0 .. q_g(h/k-1), k_g, v_g]`` stacked over groups), head_dim rows each;
* ``linear_fc1``: ``[gate_proj; up_proj]`` (SwiGLU: megatron applies silu to the first half);
* rotary embeddings un-interleaved (the ``rotate_half`` convention both use).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM"})


class WeightMappingError(ValueError):
    """A checkpoint this mapping cannot load exactly (unsupported config, missing or extra tensors)."""


@dataclass(frozen=True)
class LlamaShape:
    """What a Llama checkpoint's config.json fixes about the model (the megatron model is built from it)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def llama_shape(config: Mapping[str, Any]) -> LlamaShape:
    """The :class:`LlamaShape` of a config.json mapping; refuses what the mapping does not reproduce exactly."""
    architectures = set(config.get("architectures") or [])
    if not architectures & SUPPORTED_ARCHITECTURES:
        raise WeightMappingError(
            f"architectures {sorted(architectures)}: only {sorted(SUPPORTED_ARCHITECTURES)} is supported"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise WeightMappingError(f"{flag} is set: biased Llama variants are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise WeightMappingError(f"hidden_act {config['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise WeightMappingError(f"rope scaling {rope!r}: only the default rotary embedding is supported")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden = int(config["hidden_size"])
    if heads % kv_heads:
        raise WeightMappingError(f"{heads} attention heads are not a multiple of {kv_heads} key/value heads")
    return LlamaShape(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(config.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def read_llama_shape(folder: Path) -> LlamaShape:
    """The shape of the Hugging Face model folder ``folder`` (its config.json)."""
    return llama_shape(json.loads((folder / "config.json").read_text()))


def qkv_weight(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LlamaShape) -> torch.Tensor:
    """megatron's fused ``linear_qkv`` weight from the separate q/k/v projections (grouped layout above)."""
    d, groups, per_group = shape.head_dim, shape.num_kv_heads, shape.heads_per_group
    _expect(q, (shape.num_heads * d, shape.hidden_size), "q_proj")
    _expect(k, (groups * d, shape.hidden_size), "k_proj")
    _expect(v, (groups * d, shape.hidden_size), "v_proj")
    q = q.reshape(groups, per_group * d, -1)
    k = k.reshape(groups, d, -1)
    v = v.reshape(groups, d, -1)
    return torch.cat([q, k, v], dim=1).reshape(-1, shape.hidden_size)


def to_megatron(hf: Mapping[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """The megatron GPT state dict (local layer spec) holding exactly the tensors of ``hf``."""
    remaining = dict(hf)

    def take(name: str) -> torch.Tensor:
        try:
            return remaining.pop(name)
        except KeyError:
            raise WeightMappingError(f"checkpoint has no tensor {name!r}") from None

    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight")}
    _expect(out["embedding.word_embeddings.weight"], (shape.vocab_size, shape.hidden_size), "embed_tokens")
    for i in range(shape.num_layers):
        hf_layer, layer = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf_layer + "self_attn."
        out[layer + "input_layernorm.weight"] = take(hf_layer + "input_layernorm.weight")
        out[layer + "self_attention.linear_qkv.weight"] = qkv_weight(
            take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight"), shape
        )
        out[layer + "self_attention.linear_proj.weight"] = take(attn + "o_proj.weight")
        out[layer + "pre_mlp_layernorm.weight"] = take(hf_layer + "post_attention_layernorm.weight")
        out[layer + "mlp.linear_fc1.weight"] = torch.cat(
            [take(hf_layer + "mlp.gate_proj.weight"), take(hf_layer + "mlp.up_proj.weight")], dim=0
        )
        out[layer + "mlp.linear_fc2.weight"] = take(hf_layer + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    lm_head = remaining.pop("lm_head.weight", None)
    if not shape.tie_word_embeddings:
        if lm_head is None:
            raise WeightMappingError("checkpoint has no tensor 'lm_head.weight' and does not tie embeddings")
        out["output_layer.weight"] = lm_head
    elif lm_head is not None and not torch.equal(lm_head, out["embedding.word_embeddings.weight"]):
        raise WeightMappingError("tie_word_embeddings is set but lm_head.weight differs from embed_tokens")
    unused = sorted(name for name in remaining if not name.endswith("rotary_emb.inv_freq"))
    if unused:
        raise WeightMappingError(f"checkpoint tensors the mapping does not use: {unused[:8]}")
    return out


def load_megatron_state(folder: Path, shape: LlamaShape, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read the safetensors weights of ``folder`` on CPU and map them (``dtype``, contiguous)."""
    from safetensors.torch import load_file

    from tasks.models.bundled import weight_files

    files = weight_files(folder)
    if not files or any(file.suffix != ".safetensors" for file in files):
        raise WeightMappingError(f"{folder}: the Megatron engine reads safetensors weights only")
    hf: dict[str, torch.Tensor] = {}
    for file in files:
        hf.update(load_file(str(file)))
    return {name: tensor.to(dtype).contiguous() for name, tensor in to_megatron(hf, shape).items()}


def _expect(tensor: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != expected:
        raise WeightMappingError(f"{what}: shape {tuple(tensor.shape)}, the config implies {expected}")
