"""The Hugging Face Llama → megatron GPT weight mapping (pure PyTorch; the GPU tests run the mapped model)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tasks.engines.megatron.weights import LlamaShape, WeightMappingError, llama_shape, qkv_weight, to_megatron

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 11,
    "hidden_size": 8,
    "intermediate_size": 6,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 2,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


def _checkpoint(shape: LlamaShape) -> dict[str, torch.Tensor]:
    """A Llama state dict of ``shape`` whose every tensor is distinct (random)."""
    h, d = shape.hidden_size, shape.head_dim
    tensors = {"model.embed_tokens.weight": (shape.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (shape.num_heads * d, h),
            p + "self_attn.k_proj.weight": (shape.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (shape.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, shape.num_heads * d),
            p + "mlp.gate_proj.weight": (shape.ffn_hidden_size, h),
            p + "mlp.up_proj.weight": (shape.ffn_hidden_size, h),
            p + "mlp.down_proj.weight": (h, shape.ffn_hidden_size),
        }
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(size, generator=generator) for name, size in tensors.items()}


def test_shape_reads_transformers_5_and_older_rope_fields() -> None:
    shape = llama_shape(CONFIG)
    assert (shape.num_heads, shape.num_kv_heads, shape.heads_per_group, shape.head_dim) == (4, 2, 2, 2)
    assert shape.rope_theta == 100000.0 and shape.tie_word_embeddings
    older = {k: v for k, v in CONFIG.items() if k != "rope_parameters"} | {"rope_theta": 5e5}
    assert llama_shape(older).rope_theta == 5e5


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"architectures": ["MistralForCausalLM"]}, "only \\['LlamaForCausalLM'\\]"),
        ({"attention_bias": True}, "attention_bias is set"),
        ({"hidden_act": "gelu"}, "only 'silu'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "only the default rotary"),
        ({"num_key_value_heads": 3}, "not a multiple of 3"),
    ],
)
def test_configs_the_mapping_cannot_reproduce_are_refused(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(WeightMappingError, match=reason):
        llama_shape(CONFIG | change)


def test_fused_qkv_stacks_each_query_group_with_its_key_and_value_head() -> None:
    shape = llama_shape(CONFIG)
    rows = shape.head_dim
    q = torch.arange(4 * rows).repeat_interleave(8).reshape(-1, 8).float()  # query head j: rows 2j, 2j+1
    k = 100 + torch.arange(2 * rows).repeat_interleave(8).reshape(-1, 8).float()
    v = 200 + torch.arange(2 * rows).repeat_interleave(8).reshape(-1, 8).float()
    fused = qkv_weight(q, k, v, shape)[:, 0].tolist()
    assert fused == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


def test_every_checkpoint_tensor_lands_in_exactly_one_megatron_tensor() -> None:
    shape = llama_shape(CONFIG)
    hf = _checkpoint(shape)
    mapped = to_megatron(hf, shape)
    layer = "decoder.layers.1."
    assert torch.equal(mapped[layer + "pre_mlp_layernorm.weight"], hf["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(
        mapped[layer + "mlp.linear_fc1.weight"],
        torch.cat([hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]]),
    )
    assert torch.equal(mapped["decoder.final_layernorm.weight"], hf["model.norm.weight"])
    assert "output_layer.weight" not in mapped  # tied: the embedding is the output layer
    assert sum(t.numel() for t in mapped.values()) == sum(t.numel() for t in hf.values())


def test_untied_checkpoints_map_lm_head_to_the_output_layer() -> None:
    shape = llama_shape(CONFIG | {"tie_word_embeddings": False})
    hf = _checkpoint(shape) | {"lm_head.weight": torch.randn(shape.vocab_size, shape.hidden_size)}
    assert torch.equal(to_megatron(hf, shape)["output_layer.weight"], hf["lm_head.weight"])
    del hf["lm_head.weight"]
    with pytest.raises(WeightMappingError, match=r"no tensor 'lm_head.weight' and does not tie"):
        to_megatron(hf, shape)


def test_missing_unknown_or_misshapen_tensors_are_errors_naming_them() -> None:
    shape = llama_shape(CONFIG)
    hf = _checkpoint(shape)
    with pytest.raises(WeightMappingError, match=r"no tensor 'model.layers.0.mlp.up_proj.weight'"):
        to_megatron({k: v for k, v in hf.items() if k != "model.layers.0.mlp.up_proj.weight"}, shape)
    with pytest.raises(WeightMappingError, match=r"does not use: \['model.layers.0.self_attn.q_norm.weight'\]"):
        to_megatron(hf | {"model.layers.0.self_attn.q_norm.weight": torch.ones(2)}, shape)
    with pytest.raises(WeightMappingError, match=r"k_proj: shape \(2, 8\), the config implies \(4, 8\)"):
        to_megatron(hf | {"model.layers.0.self_attn.k_proj.weight": torch.ones(2, 8)}, shape)
    with pytest.raises(WeightMappingError, match=r"lm_head.weight differs from embed_tokens"):
        to_megatron(hf | {"lm_head.weight": torch.zeros(shape.vocab_size, shape.hidden_size)}, shape)
