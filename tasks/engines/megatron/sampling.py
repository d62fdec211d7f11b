"""The contract's sampling settings in megatron-core's terms (``SamplingParams`` fields).

Invariant: what megatron would sample differently from what the settings record is refused, never
approximated: both filters on one request (megatron cannot), and top-k 1 at a temperature (it
would be recorded as greedy). Planning refuses the same settings (:func:`refusal`, the registry's
``sampling_limits`` of the megatron engine) before any call is made.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.errors import EngineError
from tasks.sampling import SamplingSettings

GREEDY_TOP_K = 1


@dataclass(frozen=True)
class MegatronSampling:
    """A request's sampling settings in megatron's terms (``SamplingParams`` fields)."""

    temperature: float
    top_k: int
    top_p: float


def megatron_sampling(settings: SamplingSettings) -> MegatronSampling:
    """Translate the contract's sampling settings; greedy (temperature 0) is top-k 1 at temperature 1.

    megatron takes the argmax for top-k 1 and spells "off" as top-k 0 and top-p 0.0. Refused: both
    filters on one request (megatron cannot), and top-k 1 at a temperature (it would be recorded
    as greedy; ask for temperature 0).
    """
    if settings.temperature == 0.0:
        return MegatronSampling(temperature=1.0, top_k=GREEDY_TOP_K, top_p=0.0)
    reason = refusal(settings)
    if reason is not None:
        raise EngineError(reason)
    top_k = 0 if settings.top_k == -1 else settings.top_k
    top_p = 0.0 if settings.top_p == 1.0 else settings.top_p
    return MegatronSampling(temperature=float(settings.temperature), top_k=top_k, top_p=top_p)


def refusal(settings: SamplingSettings) -> str | None:
    """Why megatron cannot sample ``settings`` as recorded, or None: top-k 1 at a temperature, or top-k with top-p."""
    if settings.temperature == 0.0:
        return None
    top_k = 0 if settings.top_k == -1 else settings.top_k
    top_p = 0.0 if settings.top_p == 1.0 else settings.top_p
    if top_k == GREEDY_TOP_K:
        return "megatron engine: top_k 1 at a temperature is greedy decoding; set temperature 0 instead"
    if top_k and top_p:
        return f"megatron-core cannot combine top_k {top_k} with top_p {top_p} on one request"
    return None
