"""The test-only flash-attn stand-in computes the attention flash-attn would, over megatron's paged KV cache.

Checked on CPU against plain per-sequence causal attention, so the GPU tests that rely on it
measure megatron, not a broken stand-in.
"""

from __future__ import annotations

import torch

from tests.engines.fixtures.flash_attn_sdpa_standin import flash_attn_varlen_func, flash_attn_with_kvcache

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def _paged(sequences: list[torch.Tensor], blocks_per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache holding each ``[len, KV_HEADS, DIM]`` sequence in scattered blocks, and its block table."""
    cache = torch.randn(len(sequences) * blocks_per_row + 3, BLOCK, KV_HEADS, DIM)
    order = torch.randperm(cache.shape[0])
    table = torch.full((len(sequences), blocks_per_row), -1, dtype=torch.int32)
    used = 0
    for row, sequence in enumerate(sequences):
        for block in range(-(-len(sequence) // BLOCK)):
            index = int(order[used])
            used += 1
            chunk = sequence[block * BLOCK : (block + 1) * BLOCK]
            cache[index, : len(chunk)] = chunk
            table[row, block] = index
    return cache, table


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention of the last ``len(q)`` positions of one sequence, bottom-right aligned."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / DIM**0.5
    offset = k.shape[0] - q.shape[0]
    allowed = torch.arange(k.shape[0])[None, :] <= (offset + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_varlen_standin_matches_causal_attention_for_mixed_prefill_lengths_and_padding() -> None:
    torch.manual_seed(0)
    k_lens, q_lens = [7, 3, 10], [7, 1, 4]  # a fresh prefill, a decode row, a chunk after cached tokens
    keys = [torch.randn(n, KV_HEADS, DIM) for n in k_lens]
    values = [torch.randn(n, KV_HEADS, DIM) for n in k_lens]
    k_cache, table = _paged(keys, 3)
    v_cache = k_cache.clone()
    for row, sequence in enumerate(values):
        for block in range(-(-len(sequence) // BLOCK)):
            chunk = sequence[block * BLOCK : (block + 1) * BLOCK]
            v_cache[table[row, block], : len(chunk)] = chunk
    queries = [torch.randn(n, HEADS, DIM) for n in q_lens]
    packed = torch.cat([*queries, torch.randn(2, HEADS, DIM)])  # two padding rows at the end
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = flash_attn_varlen_func(packed, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens), block_table=table)
    expected = torch.cat([_reference(q, k, v) for q, k, v in zip(queries, keys, values, strict=True)])
    torch.testing.assert_close(out[: sum(q_lens)], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[sum(q_lens) :], torch.zeros(2, HEADS, DIM))


def test_decode_standin_matches_causal_attention_over_each_rows_cached_length() -> None:
    torch.manual_seed(1)
    k_lens = [5, 12, 1]
    keys = [torch.randn(n, KV_HEADS, DIM) for n in k_lens]
    k_cache, table = _paged(keys, 4)
    v_cache = k_cache * 0.5 + 1.0
    values = [k * 0.5 + 1.0 for k in keys]
    q = torch.randn(len(k_lens), 1, HEADS, DIM)
    out = flash_attn_with_kvcache(
        q, k_cache, v_cache, torch.tensor(k_lens, dtype=torch.int32), softmax_scale=DIM**-0.5, block_table=table
    )
    expected = torch.stack([_reference(q[b], keys[b], values[b]) for b in range(len(k_lens))])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
