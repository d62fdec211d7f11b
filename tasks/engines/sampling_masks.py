"""A truncating call's kept sets, as an engine reads them: from vLLM's own sampling mask, or from its top logprobs.

vLLM returns a sampling mask itself only where ``return_sampling_mask`` is on (Model Runner V2, GPU).
Elsewhere (vLLM-CPU) the kept set is read from the processed top-N logprobs: the sampler gives every
token it filtered out ``-inf`` (a server's answer floors it to :data:`FILTERED_FLOOR`), and every
kept token outranks every filtered one, so when fewer than N of the N candidates are finite, the
finite ones are the whole kept set. When all N are finite the set may be larger than what was
returned: the call cannot be proven, and fails (:class:`SamplingMaskOverflowError`, the capture's
``sampling_mask_overflow``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from tasks.errors import EngineError
from tasks.records.sampling_mask import KeptSets
from tasks.sampling import SamplingSettings

# A server answer's floor for a logprob (vLLM's token-in/token-out shapes turn -inf into it); every logprob
# a float32 sampler can return finitely is far above it (about -104 at least).
FILTERED_FLOOR = -9999.0


class SamplingMaskOverflowError(EngineError):
    """A sampled token's kept set may hold more ids than the engine returned candidates: it cannot be recorded."""


def candidates_to_ask(sampling: SamplingSettings, candidates: int) -> int:
    """How many top logprobs to ask per sampled token: none without truncation; with top-k, at most ``top_k + 1``
    (one more than the set can hold, ties aside, so a full set is told from a cut one)."""
    if not sampling.truncates:
        return 0
    return min(candidates, sampling.top_k + 1) if sampling.top_k > 0 else candidates


def kept_from_candidates(
    request_id: str, token_ids: Sequence[int], candidates: Sequence[Iterable[tuple[int, float]]], asked: int
) -> KeptSets:
    """The kept sets read from each sampled token's ``asked`` top (token id, processed logprob) candidates.

    Raises :class:`SamplingMaskOverflowError` where all ``asked`` candidates are kept, and
    :class:`EngineError` where the candidates do not fit the tokens (a count, a sampled token outside its set).
    """
    if len(candidates) != len(token_ids):
        raise EngineError(f"request {request_id}: {len(candidates)} candidate lists for {len(token_ids)} tokens")
    sets = []
    for position, entries in enumerate(candidates):
        kept = [token for token, logprob in entries if math.isfinite(logprob) and logprob > FILTERED_FLOOR]
        if len(kept) >= asked:
            raise SamplingMaskOverflowError(
                f"request {request_id}: token {position} kept at least {asked} ids, all the candidates asked for; "
                "raise the engine option sampling_mask_candidates, or sample with a tighter top_p / top_k"
            )
        sets.append(kept)
    return _checked(request_id, token_ids, sets)


def kept_from_engine_mask(request_id: str, token_ids: Sequence[int], mask: Sequence[Sequence[int]]) -> KeptSets:
    """The kept sets of vLLM's own sampling mask (one id list per sampled token); EngineError where they do not fit."""
    if len(mask) != len(token_ids):
        raise EngineError(f"request {request_id}: a sampling mask of {len(mask)} positions for {len(token_ids)} tokens")
    return _checked(request_id, token_ids, mask)


def _checked(request_id: str, token_ids: Sequence[int], sets: Iterable[Iterable[int]]) -> KeptSets:
    try:
        kept = KeptSets.of(sets)
        kept.check(token_ids)
    except (TypeError, ValueError) as exc:
        raise EngineError(f"request {request_id}: its sampling mask is unusable: {exc}") from None
    return kept
