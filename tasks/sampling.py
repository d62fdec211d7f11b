"""Sampling settings: the value type every layer shares (the batch config, the engines, the gateway, the records).

At the bottom layer: a batch config, a gateway request and an engine call all carry one, and none
of them should import an engine to get it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.checks import check_finite, check_int, is_int

GREEDY_TEMPERATURE = 1e-5  # below it a sampler takes the argmax (vLLM's SAMPLING_EPS): nothing is drawn


def truncates(temperature: float, top_p: float, top_k: int) -> bool:
    """Whether sampling with these settings draws from a kept subset of the vocabulary (top-p, top-k): a call
    sampled so has a sampling mask (:mod:`tasks.records.sampling_mask`)."""
    return temperature >= GREEDY_TEMPERATURE and (top_p < 1.0 or top_k > 0)


@dataclass(frozen=True)
class SamplingSettings:
    """Per-call sampling settings; recorded on every staged delta."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    logprobs_mode: str = "processed"

    def __post_init__(self) -> None:
        check_finite(self.temperature, field="temperature", error=ValueError)
        check_finite(self.top_p, field="top_p", error=ValueError)
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (off) or a positive int, got {self.top_k!r}")
        check_int(self.max_tokens, field="max_tokens", minimum=1, error=ValueError)
        if self.logprobs_mode != "processed":
            raise ValueError(f"logprobs_mode must be 'processed', got {self.logprobs_mode!r}")

    @property
    def truncates(self) -> bool:
        """Whether these settings sample from a kept subset of the vocabulary (:func:`truncates`)."""
        return truncates(self.temperature, self.top_p, self.top_k)
