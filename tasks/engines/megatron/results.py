"""A finished megatron request as the contract's :class:`~tasks.engines.base.GenerationResult`.

Invariant: a result has at least one sampled id and exactly one float32 logprob per sampled id
(the stop token included, as vLLM returns it); anything else, or a request megatron did not
complete, is an :class:`~tasks.errors.EngineError` naming the request.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tasks.engines.base import GenerationResult
from tasks.errors import EngineError


def to_generation_result(
    request_id: str,
    prompt: list[int],
    finished: Any,
    *,
    eos_token_id: int,
) -> GenerationResult:
    """Convert a finished megatron ``DynamicInferenceRequest`` to a :class:`GenerationResult`."""
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
    )
