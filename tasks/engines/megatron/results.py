"""A finished megatron request as the contract's :class:`~tasks.engines.base.GenerationResult`.

Invariant: a result has at least one sampled id and exactly one float32 logprob per sampled id
(the stop token included, as vLLM returns it), and, for a call that truncated, exactly one kept set
per sampled id holding that id (:class:`~tasks.records.sampling_mask.KeptSets`); anything else, or
a request megatron did not complete, is an :class:`~tasks.errors.EngineError` naming the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tasks.engines.base import GenerationResult
from tasks.errors import EngineError
from tasks.records.sampling_mask import KeptSets


def to_generation_result(
    request_id: str,
    prompt: list[int],
    finished: Any,
    *,
    eos_token_id: int,
    kept: Sequence[np.ndarray] | None = None,
) -> GenerationResult:
    """Convert a finished megatron ``DynamicInferenceRequest`` to a :class:`GenerationResult`.

    ``kept``: for a call that truncated, the kept ids of each sampled token in sampling order (int32,
    ascending; :class:`~tasks.engines.megatron.kept.KeptRecorder`); None for one that did not.
    """
    status = getattr(finished.status, "name", str(finished.status))
    if status != "COMPLETED":
        errors = [str(e.payload) for e in (finished.events or []) if "ERROR" in getattr(e.type, "name", "")]
        raise EngineError(f"request {request_id}: megatron ended it as {status}: {'; '.join(errors) or 'no detail'}")
    token_ids = tuple(int(t) for t in finished.generated_tokens)
    logprobs = np.asarray(finished.generated_log_probs or [], dtype=np.float32)
    if len(logprobs) != len(token_ids):
        raise EngineError(
            f"request {request_id}: megatron returned {len(logprobs)} logprobs for {len(token_ids)} tokens"
        )
    if not token_ids:
        raise EngineError(f"request {request_id}: megatron generated no token")
    return GenerationResult(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason="stop" if token_ids[-1] == eos_token_id else "length",
        text=finished.generated_text or "",
        kept=None if kept is None else kept_sets(request_id, token_ids, kept),
    )


def kept_sets(request_id: str, token_ids: Sequence[int], kept: Sequence[np.ndarray]) -> KeptSets:
    """The recorded kept ids as :class:`KeptSets` (CSR), checked against the sampled ids; EngineError where they
    do not fit (a count, a token outside its own set)."""
    if len(kept) != len(token_ids):
        raise EngineError(
            f"request {request_id}: megatron's sampler recorded {len(kept)} kept sets for {len(token_ids)} tokens"
        )
    sets = KeptSets(
        counts=np.fromiter((len(ids) for ids in kept), np.int32, len(kept)),
        token_ids=np.concatenate(kept).astype(np.int32, copy=False) if kept else np.zeros(0, np.int32),
    )
    try:
        sets.check(token_ids)
    except ValueError as exc:
        raise EngineError(f"request {request_id}: its sampling mask is unusable: {exc}") from None
    return sets
