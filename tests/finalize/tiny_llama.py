"""A 2-layer Llama with a 64-token vocabulary, peaky enough that top-k / top-p filter something (audit tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 64


def tiny_llama(path: Path, *, seed: int) -> tuple[str, Any]:
    """The model (eval mode) saved at ``path``: its folder and the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return str(path), model
