"""tasks.models.logprobs against vLLM's processing as the logprob audit reimplements it (fp32, random logits)."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.finalize.logprob_audit import processed_log_softmax
from tasks.models.logprobs import full_vocab_logprobs, kept_set_logprobs


def _kept(processed: torch.Tensor) -> tuple[list[int], list[int]]:
    counts, ids = [], []
    for row in processed:
        kept = torch.nonzero(torch.isfinite(row))[:, 0].tolist()
        counts.append(len(kept))
        ids += kept
    return counts, ids


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.8, 0.9, 20), (1.0, 0.7, -1), (0.6, 1.0, 5)])
def test_over_the_kept_set_it_is_the_samplers_logprob_and_over_the_vocabulary_lower_by_the_kept_mass(
    temperature, top_p, top_k
):
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(7)) * 3
    processed = processed_log_softmax(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = torch.multinomial(processed.exp(), 1, generator=torch.Generator().manual_seed(3))[:, 0]
    counts, ids = _kept(processed)
    sampler = processed.gather(1, tokens[:, None])[:, 0]
    kept = kept_set_logprobs(logits, tokens, temperature, counts, ids)
    torch.testing.assert_close(kept, sampler, atol=1e-5, rtol=0)
    full = full_vocab_logprobs(logits, tokens, temperature)
    position = torch.repeat_interleave(torch.arange(16), torch.tensor(counts))
    mass = torch.zeros(16).index_add(0, position, (logits / temperature).softmax(-1)[position, torch.tensor(ids)])
    torch.testing.assert_close(full - kept, mass.log(), atol=1e-5, rtol=0)


def test_a_token_outside_its_kept_set_is_impossible_and_gradients_flow_through_the_set():
    logits = torch.randn(2, 10, requires_grad=True)
    out = kept_set_logprobs(logits, torch.tensor([1, 9]), 1.0, [2, 1], [1, 2, 4])
    assert math.isinf(out[1].item()) and out[1].item() < 0
    out[0].backward()
    assert logits.grad[0, [1, 2]].abs().min() > 0 and logits.grad[0, 3:].abs().max() == 0


def test_kept_sets_that_do_not_fit_the_positions_are_refused():
    with pytest.raises(ValueError, match="do not fit 2 positions"):
        kept_set_logprobs(torch.zeros(2, 4), torch.tensor([0, 1]), 1.0, [1], [0])


def test_a_greedy_temperature_is_the_raw_log_softmax():
    logits = torch.randn(3, 8)
    tokens = torch.tensor([0, 1, 2])
    torch.testing.assert_close(full_vocab_logprobs(logits, tokens, 0.0), logits.log_softmax(-1)[[0, 1, 2], tokens])
