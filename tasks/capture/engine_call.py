"""The engine call of a captured call (docs/architecture.md §5, step 4): token ids in, sampled ids out.

:func:`generate` sends the prepared prompt as a :class:`GenerationRequest` with the plan's
sampling, the call's seed and at most the tokens the context leaves. An engine error is the
call's named failure (``engine_error``), and so is an answer on a prompt other than the one sent
(``engine_prompt_mismatch``): a call is never recorded on tokens it was not sampled on. A call that
truncates (top-p, top-k) is recorded only with each sampled token's kept set: one the engine could
not read whole is ``sampling_mask_overflow``, an answer without them ``sampling_mask_missing``. The
engine dying (:class:`EngineDeadError`) is no failure of the call: it propagates.
"""

from __future__ import annotations

import numpy as np

from tasks.capture.admission import AdmittedVersion
from tasks.capture.faults import (
    ENGINE_ERROR,
    ENGINE_PROMPT_MISMATCH,
    SAMPLING_MASK_MISSING,
    SAMPLING_MASK_OVERFLOW,
    CallFault,
)
from tasks.crash_points import crash_point
from tasks.engines.base import Engine, GenerationRequest, GenerationResult
from tasks.engines.sampling_masks import SamplingMaskOverflowError
from tasks.errors import EngineDeadError
from tasks.sampling import SamplingSettings


def token_budget(engine: Engine, sampling: SamplingSettings, prompt: np.ndarray, max_tokens: int | None) -> int:
    """How many tokens a call on ``prompt`` may sample: the plan's, lowered by ``max_tokens`` and by the context."""
    return min(max_tokens or sampling.max_tokens, engine.max_model_len - prompt.size)


async def generate(
    engine: Engine,
    sampling: SamplingSettings,
    call_id: str,
    prompt: np.ndarray,
    seed: int,
    session_id: str,
    max_tokens: int | None = None,
) -> tuple[GenerationResult, AdmittedVersion]:
    """The engine's answer to ``prompt`` and the weight version the call keeps; ``max_tokens`` may
    only lower the plan's."""
    admitted = AdmittedVersion.stamp(engine)
    prompt_ids = tuple(prompt.tolist())
    request = GenerationRequest(
        request_id=call_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        seed=seed,
        max_tokens=token_budget(engine, sampling, prompt, max_tokens),
        session_id=session_id,
    )
    try:
        completion = await engine.generate(request)
        crash_point("engine_output", call_id)
    except EngineDeadError:
        raise
    except SamplingMaskOverflowError as exc:
        raise CallFault(SAMPLING_MASK_OVERFLOW, str(exc)) from None
    except Exception as exc:
        raise CallFault(ENGINE_ERROR, f"engine failed {call_id}: {exc!r}") from None
    if tuple(completion.prompt_token_ids) != prompt_ids:
        raise CallFault(
            ENGINE_PROMPT_MISMATCH,
            f"the engine ran {call_id} on a prompt other than the one prepared "
            f"({len(completion.prompt_token_ids)} vs {len(prompt)} tokens)",
            completion,
        )
    if sampling.truncates and (completion.kept is None or len(completion.kept) != len(completion.token_ids)):
        raise CallFault(
            SAMPLING_MASK_MISSING,
            f"engine {engine.name} answered {call_id}, sampled with top_p {sampling.top_p} / top_k {sampling.top_k}, "
            f"without the kept set of each of its {len(completion.token_ids)} tokens",
            completion,
        )
    return completion, admitted.spanning(completion.weight_spans)
