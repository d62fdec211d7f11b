"""What verification hands to dataset assembly: one linearized rollout, or a named reason why not.

Produced by :mod:`tasks.finalize.verify` (one per receipt, never raising for one bad rollout),
consumed by :mod:`tasks.finalize.dataset` (rows, groups, advantages). ``reason`` is None exactly
when the rollout is trainable; a rollout whose linearization succeeded but that is invalid for
another reason (e.g. a poisoned receipt after a clean chain) keeps its verified tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class CallSpan:
    """One call of the linearized chain: its carried prompt tokens, then its sampled tokens."""

    call_id: str
    carry_len: int
    gen_len: int


@dataclass(frozen=True)
class WeightSpan:
    """Tokens ``[start, end)`` of the row were produced by a call admitted at ``weight_version``."""

    call_id: str
    start: int
    end: int
    weight_version: int


_EMPTY_I32 = np.zeros(0, np.int32)
_EMPTY_U8 = np.zeros(0, np.uint8)
_EMPTY_F32 = np.zeros(0, np.float32)


@dataclass(frozen=True)
class VerifiedRollout:
    batch_id: str
    group_id: str
    rollout_id: str
    reward: float | None
    reason: str | None  # None: valid and trainable; else a stable reason string (docs/contract.md)
    input_ids: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32, root→terminal
    loss_mask: np.ndarray = field(default_factory=lambda: _EMPTY_U8)  # uint8, 1 = sampled
    logprobs: np.ndarray = field(default_factory=lambda: _EMPTY_F32)  # float32, 0 where loss_mask is 0
    prompt_len: int = 0  # carried tokens of the root call
    call_spans: tuple[CallSpan, ...] = ()
    weight_spans: tuple[WeightSpan, ...] = ()
    truncated: bool = False  # the terminal call stopped on length
    num_turns: int = 0  # calls on the chain root→terminal
    terminal_selection: str | None = None
    epoch_span_count: int = 0  # calls on the chain that spanned a refit

    @property
    def valid(self) -> bool:
        return self.reason is None

    @property
    def linearized(self) -> bool:
        return self.input_ids.size > 0
