"""What verification hands to dataset assembly: one linearized rollout, or a named reason why not.

Produced by :mod:`tasks.finalize.verify` (one per receipt, never raising for one bad rollout),
consumed by :mod:`tasks.finalize.dataset` (rows, groups, advantages). ``reason`` is None exactly
when the rollout is trainable; a rollout whose linearization succeeded but that is invalid for
another reason (e.g. a poisoned receipt after a clean chain) keeps its verified tokens.

:class:`VerifiedRollout` is one rollout's verdict as an object; :class:`VerifiedRollouts` holds
the verdicts of a whole shard as columns, their tokens and call spans as flat arrays
(:class:`Linearized`), so finalization builds no object per call. Each converts to the other.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from tasks.finalize.runs import gather, offsets


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


@dataclass(frozen=True)
class Linearized:
    """Linearized chains laid end to end as flat columns: what :class:`VerifiedRollout` holds, without per-call objects.

    Chain ``k`` holds tokens ``token_starts[k]:token_starts[k + 1]`` of ``input_ids`` (int32),
    ``loss_mask`` (uint8) and ``logprobs`` (float32), and calls ``call_starts[k]:call_starts[k + 1]``
    root→terminal: each call's id, its ``carry_len`` carried then ``gen_len`` sampled tokens
    (int64) and the ``weight_version`` (uint64) it was admitted at, which covers the call's
    tokens. ``truncated`` (per chain): the terminal call stopped on length. Every chain has at
    least one call and one token.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    token_starts: np.ndarray
    call_ids: pa.Array
    carry_len: np.ndarray
    gen_len: np.ndarray
    weight_version: np.ndarray
    call_starts: np.ndarray
    truncated: np.ndarray

    def __len__(self) -> int:
        return self.token_starts.size - 1

    @classmethod
    def empty(cls) -> Linearized:
        return cls.of([])

    @classmethod
    def of(cls, rollouts: Sequence[VerifiedRollout]) -> Linearized:
        """The chains of linearized rollouts, in order; ValueError unless each weight span is its call's tokens."""
        for v in rollouts:
            ends = np.cumsum([s.carry_len + s.gen_len for s in v.call_spans]).tolist()
            whole = [(c.call_id, end - c.carry_len - c.gen_len, end) for c, end in zip(v.call_spans, ends, strict=True)]
            if [(w.call_id, w.start, w.end) for w in v.weight_spans] != whole:
                raise ValueError(f"verified rollout {v.rollout_id}: weight spans are not its calls' token ranges")
        spans = [s for v in rollouts for s in v.call_spans]
        versions = [s.weight_version for v in rollouts for s in v.weight_spans]
        return cls(
            input_ids=np.concatenate([_EMPTY_I32, *(v.input_ids for v in rollouts)]),
            loss_mask=np.concatenate([_EMPTY_U8, *(v.loss_mask for v in rollouts)]),
            logprobs=np.concatenate([_EMPTY_F32, *(v.logprobs for v in rollouts)]),
            token_starts=offsets([v.input_ids.size for v in rollouts]),
            call_ids=pa.array([s.call_id for s in spans], pa.string()),
            carry_len=np.array([s.carry_len for s in spans], np.int64),
            gen_len=np.array([s.gen_len for s in spans], np.int64),
            weight_version=np.array(versions, np.uint64),
            call_starts=offsets([len(v.call_spans) for v in rollouts]),
            truncated=np.array([v.truncated for v in rollouts], bool),
        )

    def take(self, chains: np.ndarray) -> Linearized:
        """The given chains, in the given order (self when that is every chain in order)."""
        chains = np.asarray(chains, np.int64)
        if chains.size == len(self) and np.array_equal(chains, np.arange(len(self))):
            return self
        tokens, token_starts = gather(self.token_starts, chains)
        calls, call_starts = gather(self.call_starts, chains)
        return Linearized(
            input_ids=self.input_ids[tokens],
            loss_mask=self.loss_mask[tokens],
            logprobs=self.logprobs[tokens],
            token_starts=token_starts,
            call_ids=self.call_ids.take(pa.array(calls)),
            carry_len=self.carry_len[calls],
            gen_len=self.gen_len[calls],
            weight_version=self.weight_version[calls],
            call_starts=call_starts,
            truncated=self.truncated[chains],
        )

    def rollout_fields(self, chain: int) -> dict[str, Any]:
        """The token fields of :class:`VerifiedRollout` for one chain."""
        lo, hi = int(self.token_starts[chain]), int(self.token_starts[chain + 1])
        first, last = int(self.call_starts[chain]), int(self.call_starts[chain + 1])
        call_ids = self.call_ids[first:last].to_pylist()
        carry, gen = self.carry_len[first:last].tolist(), self.gen_len[first:last].tolist()
        ends = np.cumsum(self.carry_len[first:last] + self.gen_len[first:last]).tolist()
        versions = self.weight_version[first:last].tolist()
        return {
            "input_ids": _read_only(self.input_ids[lo:hi].copy()),
            "loss_mask": _read_only(self.loss_mask[lo:hi].copy()),
            "logprobs": _read_only(self.logprobs[lo:hi].copy()),
            "prompt_len": carry[0],
            "call_spans": tuple(CallSpan(c, k, g) for c, k, g in zip(call_ids, carry, gen, strict=True)),
            "weight_spans": tuple(
                WeightSpan(c, end - k - g, end, v)
                for c, k, g, end, v in zip(call_ids, carry, gen, ends, versions, strict=True)
            ),
            "truncated": bool(self.truncated[chain]),
            "num_turns": last - first,
        }


@dataclass(frozen=True)
class VerifiedRollouts:
    """What :class:`VerifiedRollout` says, for many rollouts at once (entry ``i`` per rollout).

    ``chain[i]`` is the rollout's chain in ``linearized`` (-1: not linearized, no tokens);
    ``reasons[i]`` is None exactly when it is trainable.
    """

    batch_id: str
    group_ids: list[str]
    rollout_ids: list[str]
    rewards: list[float | None]
    reasons: list[str | None]
    terminal_selections: list[str | None]
    epoch_span_counts: np.ndarray
    chain: np.ndarray
    linearized: Linearized

    def __len__(self) -> int:
        return len(self.rollout_ids)

    def __iter__(self) -> Iterator[VerifiedRollout]:
        for i, chain in enumerate(self.chain.tolist()):
            tokens = self.linearized.rollout_fields(chain) if chain >= 0 else {}
            yield VerifiedRollout(
                batch_id=self.batch_id,
                group_id=self.group_ids[i],
                rollout_id=self.rollout_ids[i],
                reward=self.rewards[i],
                reason=self.reasons[i],
                terminal_selection=self.terminal_selections[i],
                epoch_span_count=int(self.epoch_span_counts[i]),
                **tokens,
            )

    @classmethod
    def of(cls, batch_id: str, rollouts: Sequence[VerifiedRollout]) -> VerifiedRollouts:
        """The verdicts of rollouts of ``batch_id``, in order; ValueError for a rollout of another batch."""
        for v in rollouts:
            if v.batch_id != batch_id:
                raise ValueError(f"verified rollout {v.rollout_id} is of batch {v.batch_id}, not {batch_id}")
        linearized = [v for v in rollouts if v.linearized]
        chain = np.full(len(rollouts), -1, np.int64)
        chain[[i for i, v in enumerate(rollouts) if v.linearized]] = np.arange(len(linearized))
        return cls(
            batch_id=batch_id,
            group_ids=[v.group_id for v in rollouts],
            rollout_ids=[v.rollout_id for v in rollouts],
            rewards=[v.reward for v in rollouts],
            reasons=[v.reason for v in rollouts],
            terminal_selections=[v.terminal_selection for v in rollouts],
            epoch_span_counts=np.array([v.epoch_span_count for v in rollouts], np.int64),
            chain=chain,
            linearized=Linearized.of(linearized),
        )


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array
