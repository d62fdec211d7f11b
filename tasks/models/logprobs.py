"""A policy's logprob of a sampled token, the two ways a trainer can take it (torch, imported by the caller).

* :func:`full_vocab_logprobs`: log-softmax of ``logits / temperature`` over the whole vocabulary. Under
  top-p / top-k sampling this is *not* the sampler's distribution: it is lower by ``log S``, the kept mass.
* :func:`kept_set_logprobs`: log-softmax of ``logits / temperature`` over the ids the sampler kept for that
  token (a row's ``kept_counts`` / ``kept_token_ids``, docs/contract.md): the distribution the token was drawn
  from, so a ratio against the stored logprob starts at 1 on-policy.

Both are differentiable in ``logits`` and follow vLLM's greedy rule (a temperature below
:data:`~tasks.sampling.GREEDY_TEMPERATURE` is the raw log-softmax). Rows ``[P, V]`` of ``logits`` are the
logits that scored positions ``P`` (those at ``t - 1`` for token ``t``). The trainer and the off-policy gate
both call these: one definition of "the logprob a trainer compares with ours".
"""

from __future__ import annotations

from typing import Any

from tasks.sampling import GREEDY_TEMPERATURE


def _scaled(logits: Any, temperature: float) -> Any:
    import torch

    logits = logits.to(torch.float32)
    if temperature < GREEDY_TEMPERATURE:
        return logits
    return logits / torch.tensor(temperature, dtype=torch.float32, device=logits.device)


def full_vocab_logprobs(logits: Any, tokens: Any, temperature: float) -> Any:
    """``[P]`` logprob of ``tokens[p]`` under ``softmax(logits[p] / temperature)`` over the whole vocabulary."""
    scaled = _scaled(logits, temperature)
    return scaled.log_softmax(dim=-1).gather(1, tokens.long()[:, None])[:, 0]


def kept_set_logprobs(logits: Any, tokens: Any, temperature: float, kept_counts: Any, kept_token_ids: Any) -> Any:
    """``[P]`` logprob of ``tokens[p]`` renormalized over its kept set (``kept_counts[p]`` ids of ``kept_token_ids``).

    ``kept_counts`` has one count per position; ``kept_token_ids`` holds the sets one after another. A token
    outside its own set gets ``-inf`` (the recorded mask says it could not have been sampled).
    """
    import torch

    scaled = _scaled(logits, temperature)
    counts = torch.as_tensor(kept_counts, dtype=torch.long, device=scaled.device)
    ids = torch.as_tensor(kept_token_ids, dtype=torch.long, device=scaled.device)
    if counts.numel() != scaled.shape[0] or int(counts.sum()) != ids.numel():
        raise ValueError(
            f"kept sets ({counts.numel()} counts of {int(counts.sum())} ids, {ids.numel()} ids given) "
            f"do not fit {scaled.shape[0]} positions"
        )
    position = torch.repeat_interleave(torch.arange(counts.numel(), device=scaled.device), counts)
    peak = scaled.max(dim=-1).values.detach()
    mass = torch.zeros(counts.numel(), dtype=scaled.dtype, device=scaled.device)
    mass = mass.index_add(0, position, (scaled[position, ids] - peak[position]).exp())
    picked = scaled.gather(1, tokens.long()[:, None])[:, 0]
    member = torch.zeros(counts.numel(), dtype=torch.bool, device=scaled.device)
    member = member.index_put((position,), ids == tokens.long()[position], accumulate=True)
    return torch.where(member, picked - peak - mass.log(), torch.full_like(picked, -float("inf")))
