"""What verification hands to row assembly: every planned rollout's verdict, as columns.

:class:`VerifiedRollouts` holds one entry per planned rollout of a shard: its identity, reward,
terminal selection and ``reason`` (None exactly when the rollout is trainable). The tokens of
every chain that linearized are laid end to end in :class:`Linearized`, so nothing is built per
rollout or per call. A rollout that is invalid for another reason than its chain (a poisoned
receipt over a clean chain, say) still points at its verified tokens. Every call of a linearized
chain was sampled with the batch's sampling settings (:attr:`VerifiedRollouts.sampling`: a call
that differs fails its chain, ``wrong_<field>``) and, when they truncate, carries its kept sets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from tasks.finalize.ragged import gather, offsets
from tasks.sampling import SamplingSettings


@dataclass(frozen=True)
class Linearized:
    """Linearized chains laid end to end as flat columns.

    Chain ``k`` holds tokens ``token_starts[k]:token_starts[k + 1]`` of ``input_ids`` (int32),
    ``loss_mask`` (uint8) and ``logprobs`` (float32), and calls ``call_starts[k]:call_starts[k + 1]``
    root→terminal: each call's id, its ``carry_len`` carried then ``gen_len`` sampled tokens
    (int64), the ``weight_version`` (uint64) it was admitted at, which covers the call's
    tokens, and its verified ``extras_json`` (which may name the weights that sampled them,
    :mod:`tasks.finalize.weights`). ``truncated`` (per chain): the terminal call stopped on
    length. Every chain has at least one call and one token.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    token_starts: np.ndarray
    call_ids: pa.Array
    carry_len: np.ndarray
    gen_len: np.ndarray
    weight_version: np.ndarray
    extras_json: pa.Array
    call_starts: np.ndarray
    truncated: np.ndarray
    kept_counts: np.ndarray
    kept_token_ids: np.ndarray
    kept_count_starts: np.ndarray
    kept_id_starts: np.ndarray

    def __len__(self) -> int:
        return self.token_starts.size - 1

    @classmethod
    def empty(cls) -> Linearized:
        """No chain at all."""
        none = offsets([])
        return cls(
            input_ids=np.zeros(0, np.int32),
            loss_mask=np.zeros(0, np.uint8),
            logprobs=np.zeros(0, np.float32),
            token_starts=none,
            call_ids=pa.array([], pa.string()),
            carry_len=np.zeros(0, np.int64),
            gen_len=np.zeros(0, np.int64),
            weight_version=np.zeros(0, np.uint64),
            extras_json=pa.array([], pa.string()),
            call_starts=none,
            truncated=np.zeros(0, bool),
            kept_counts=np.zeros(0, np.int32),
            kept_token_ids=np.zeros(0, np.int32),
            kept_count_starts=none,
            kept_id_starts=none,
        )

    def take(self, chains: np.ndarray) -> Linearized:
        """The given chains, in the given order (self when that is every chain in order)."""
        chains = np.asarray(chains, np.int64)
        if chains.size == len(self) and np.array_equal(chains, np.arange(len(self))):
            return self
        tokens, token_starts = gather(self.token_starts, chains)
        calls, call_starts = gather(self.call_starts, chains)
        counts, kept_count_starts = gather(self.kept_count_starts, chains)
        kept_ids, kept_id_starts = gather(self.kept_id_starts, chains)
        return Linearized(
            input_ids=self.input_ids[tokens],
            loss_mask=self.loss_mask[tokens],
            logprobs=self.logprobs[tokens],
            token_starts=token_starts,
            call_ids=self.call_ids.take(pa.array(calls)),
            carry_len=self.carry_len[calls],
            gen_len=self.gen_len[calls],
            weight_version=self.weight_version[calls],
            extras_json=self.extras_json.take(pa.array(calls)),
            call_starts=call_starts,
            truncated=self.truncated[chains],
            kept_counts=self.kept_counts[counts],
            kept_token_ids=self.kept_token_ids[kept_ids],
            kept_count_starts=kept_count_starts,
            kept_id_starts=kept_id_starts,
        )


@dataclass(frozen=True)
class VerifiedRollouts:
    """The verdicts of many rollouts (entry ``i`` per rollout) over their linearized chains.

    ``chain[i]`` is the rollout's first chain in ``linearized`` (-1: not linearized, no tokens)
    and ``chain_counts[i]`` how many consecutive chains are its (0 without; 1 root→terminal; one
    per call under independent calls); ``reasons[i]`` is None exactly when it is trainable;
    ``epoch_span_counts[i]`` counts the calls of its chains that spanned a refit. ``sampling`` is
    the batch's sampling settings, which every call of every linearized chain was proven to have
    sampled with.
    """

    batch_id: str
    group_ids: list[str]
    rollout_ids: list[str]
    rewards: list[float | None]
    reasons: list[str | None]
    terminal_selections: list[str | None]
    epoch_span_counts: np.ndarray
    chain: np.ndarray
    chain_counts: np.ndarray
    linearized: Linearized
    sampling: SamplingSettings

    def __len__(self) -> int:
        return len(self.rollout_ids)


class VerdictsBuilder:
    """Builds :class:`VerifiedRollouts` verdict by verdict (Python per rollout: scalars only)."""

    def __init__(self, batch_id: str, sampling: SamplingSettings) -> None:
        self.batch_id = batch_id
        self.sampling = sampling
        self._fields: tuple[list, ...] = ([], [], [], [], [], [], [], [])

    def add(
        self,
        group_id: str,
        rollout_id: str,
        reward: float | None,
        reason: str | None,
        terminal_selection: str | None,
        chain: int = -1,
        chain_count: int = 0,
        epoch_spans: int = 0,
    ) -> None:
        """One rollout's verdict; its chains are ``chain_count`` of the linearized chains given to
        :meth:`build`, from ``chain``."""
        values = (group_id, rollout_id, reward, reason, terminal_selection, chain, chain_count, epoch_spans)
        for cells, value in zip(self._fields, values, strict=True):
            cells.append(value)

    def build(self, linearized: Linearized) -> VerifiedRollouts:
        group_ids, rollout_ids, rewards, reasons, selections, chains, counts, epoch_spans = self._fields
        return VerifiedRollouts(
            batch_id=self.batch_id,
            group_ids=group_ids,
            rollout_ids=rollout_ids,
            rewards=rewards,
            reasons=reasons,
            terminal_selections=selections,
            epoch_span_counts=np.array(epoch_spans, np.int64),
            chain=np.array(chains, np.int64),
            chain_counts=np.array(counts, np.int64),
            linearized=linearized,
            sampling=self.sampling,
        )
