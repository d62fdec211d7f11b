"""The engine contract: one interface every inference backend implements (vLLM, Megatron-core).

An engine generates from token-id prompts and returns exactly what it sampled: the token ids,
each sampled token's logprob under the distribution it was sampled from (``processed``:
after temperature / top-p / top-k), float32, the finish reason, and the prompt ids it really
used. It starts at the batch's ``weight_version`` and a refit (:meth:`Engine.update_weights`) raises it.
A call that truncates (top-p, top-k) also returns each sampled token's kept set (its sampling mask,
:mod:`tasks.records.sampling_mask`); planning refuses truncation on an engine the registry does not
list as capturing masks, and the capture fails a truncated call returned without them.
Engines are async so one event loop can keep every in-flight rollout of a shard in the
engine's continuous batch.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.checks import check_int
from tasks.errors import EngineError
from tasks.models.provenance import WEIGHTS_VERIFIED
from tasks.sampling import SamplingSettings

if TYPE_CHECKING:
    import numpy as np  # engine modules are imported at DAG parse time (the registry): no numpy import there

    from tasks.records.sampling_mask import KeptSets

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class GenerationRequest:
    """One model call: a token-id prompt, its sampling settings and its seed."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSettings
    seed: int
    max_tokens: int | None = None  # overrides sampling.max_tokens, e.g. clipped to the context left
    session_id: str | None = None  # calls of one rollout share it: an engine with replicas keeps them on one


@dataclass(frozen=True)
class WeightVersionSpan:
    """Sampled tokens ``[start, end)`` of one call came from the weights of ``version``."""

    version: int
    start: int
    end: int


# The key of a result's ``metadata`` naming the server that answered (engines of several servers).
SERVED_BY = "server"


@dataclass(frozen=True)
class GenerationResult:
    """What the engine did for one request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: np.ndarray  # float32, one per sampled token
    finish_reason: str
    text: str
    extras: Any = None  # backend-specific per-call data covered by the extras digest (e.g. routed experts)
    response_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # The engine's own account of which weights sampled which tokens, in order; empty where the
    # engine only stamps the version at admission (the in-process engines).
    weight_spans: tuple[WeightVersionSpan, ...] = ()
    # Each sampled token's kept set, for a call that truncated; None for one that did not.
    kept: KeptSets | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"request {self.request_id}: {len(self.logprobs)} logprobs for {len(self.token_ids)} sampled tokens"
            )


class Engine(abc.ABC):
    """An inference backend. Create it, ``await generate(...)`` concurrently, ``await close()``.

    The base keeps what every engine reports the same way: the served tokenizer, ``max_model_len``
    and the weight version, set once by :meth:`__init__`; a refit moves ``_weight_version``.
    An engine the registry starts by name (:mod:`tasks.engines.registry`) implements :meth:`create`.
    """

    name: str = "engine"
    # how the weights are known to be the planned model's (:data:`tasks.models.provenance.WEIGHT_CHECKS`):
    # an engine that loads them on its worker hashes them there
    weights: str = WEIGHTS_VERIFIED

    def __init__(self, *, tokenizer: Any, max_model_len: int, weight_version: int = 0) -> None:
        self._tokenizer = tokenizer
        self._max_model_len = int(max_model_len)
        self._weight_version = weight_version

    @classmethod
    async def create(cls, model_path: str | Path, options: Any, *, weight_version: int = 0) -> Engine:
        """Start the engine on the local model folder ``model_path`` with its options model, at ``weight_version``."""
        raise NotImplementedError(f"{cls.__name__} is not started by name")

    @property
    def weight_version(self) -> int:
        """Version of the weights now loaded; stamped on each call at admission."""
        return self._weight_version

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (with chat template) matching the served weights."""
        return self._tokenizer

    def decode(self, token_ids: Sequence[int], tokenizer: Any = None) -> str:
        """The text of sampled ``token_ids`` as this engine reports it (``GenerationResult.text``), decoded with
        ``tokenizer`` (default: the engine's). A replayed call's text is made here
        (:mod:`tasks.generate.resume`); an engine whose text is not this decode says so by overriding it."""
        return (tokenizer or self._tokenizer).decode(list(token_ids), skip_special_tokens=True)

    @property
    def eos_token_id(self) -> int:
        """End-of-turn token id: the splice boundary (docs/contract.md)."""
        return int(self._tokenizer.eos_token_id)

    @property
    def max_model_len(self) -> int:
        """Longest prompt + generation the engine accepts, in tokens."""
        return self._max_model_len

    def prompt_of(self, request: GenerationRequest) -> list[int]:
        """The request's prompt ids; an :class:`EngineError` when it is empty or leaves no room to generate."""
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise EngineError(f"request {request.request_id}: empty prompt")
        if len(prompt) >= self._max_model_len:
            raise EngineError(
                f"request {request.request_id}: prompt of {len(prompt)} tokens leaves no room to generate "
                f"(max_model_len {self._max_model_len})"
            )
        return prompt

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Sample a completion for ``request``; raise :class:`EngineError` on failure."""

    @abc.abstractmethod
    async def update_weights(self, model_path: str, *, version: int | None = None) -> int:
        """Load new weights (a refit) and return the new weight version.

        ``version`` (a trainer's policy step) must exceed the current one; ``None`` means current + 1.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Shut the engine down; an engine left running hangs the process at exit."""


def next_weight_version(current: int, requested: int | None) -> int:
    """The version a refit moves to: ``requested`` when it exceeds ``current``, else an error."""
    if requested is None:
        return current + 1
    return check_int(
        requested, field=f"a refit's weight version (now {current})", minimum=current + 1, error=EngineError
    )
