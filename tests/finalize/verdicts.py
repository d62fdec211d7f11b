"""Test-side view of verdicts: one rollout's verdict as an object.

Finalization keeps verdicts as columns (:class:`VerifiedRollouts` over flat :class:`Linearized`
chains) and never builds an object per rollout. Tests read them rollout by rollout
(:func:`rollouts_of`) and build synthetic ones from objects (:func:`columns_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from tasks.finalize.ragged import offsets
from tasks.finalize.verify.verdicts import Linearized, VerifiedRollouts
from tasks.records.dataset_row import CallSpan, WeightSpan
from tasks.records.sampling_mask import KeptSets
from tasks.sampling import SamplingSettings

UNTRUNCATED = SamplingSettings(temperature=1.0)  # what synthetic verdicts were sampled with unless a test says


@dataclass(frozen=True)
class VerifiedRollout:
    """One rollout's verdict; ``reason`` None exactly when trainable; empty token arrays when not linearized."""

    batch_id: str
    group_id: str
    rollout_id: str
    reward: float | None
    reason: str | None
    input_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    loss_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    prompt_len: int = 0
    call_spans: tuple[CallSpan, ...] = ()
    weight_spans: tuple[WeightSpan, ...] = ()
    extras_json: tuple[str, ...] = ()  # per call, as staged (canonical JSON); none given: "null" each
    truncated: bool = False
    num_turns: int = 0
    terminal_selection: str | None = None
    epoch_span_count: int = 0
    kept: KeptSets = field(default_factory=KeptSets.empty)  # the chain's sampling mask, one set per sampled token

    @property
    def valid(self) -> bool:
        return self.reason is None

    @property
    def linearized(self) -> bool:
        return self.input_ids.size > 0


def rollouts_of(verified: VerifiedRollouts) -> list[VerifiedRollout]:
    """Every verdict of ``verified`` as an object, in order."""
    chains = verified.linearized
    rollouts = []
    for i, chain in enumerate(verified.chain.tolist()):
        tokens = _chain_fields(chains, chain) if chain >= 0 else {}
        rollouts.append(
            VerifiedRollout(
                batch_id=verified.batch_id,
                group_id=verified.group_ids[i],
                rollout_id=verified.rollout_ids[i],
                reward=verified.rewards[i],
                reason=verified.reasons[i],
                terminal_selection=verified.terminal_selections[i],
                epoch_span_count=int(verified.epoch_span_counts[i]),
                **tokens,
            )
        )
    return rollouts


def _chain_fields(chains: Linearized, chain: int) -> dict[str, object]:
    tokens = slice(int(chains.token_starts[chain]), int(chains.token_starts[chain + 1]))
    calls = slice(int(chains.call_starts[chain]), int(chains.call_starts[chain + 1]))
    call_spans, weight_spans, end = [], [], 0
    for call_id, carry, gen, version in zip(
        chains.call_ids[calls].to_pylist(),
        chains.carry_len[calls].tolist(),
        chains.gen_len[calls].tolist(),
        chains.weight_version[calls].tolist(),
        strict=True,
    ):
        call_spans.append(CallSpan(call_id, carry, gen))
        weight_spans.append(WeightSpan(call_id, end, end + carry + gen, version))
        end += carry + gen
    return {
        "input_ids": chains.input_ids[tokens],
        "loss_mask": chains.loss_mask[tokens],
        "logprobs": chains.logprobs[tokens],
        "prompt_len": call_spans[0].carry_len,
        "call_spans": tuple(call_spans),
        "weight_spans": tuple(weight_spans),
        "extras_json": tuple(chains.extras_json[calls].to_pylist()),
        "truncated": bool(chains.truncated[chain]),
        "num_turns": len(call_spans),
        "kept": KeptSets(
            chains.kept_counts[chains.kept_count_starts[chain] : chains.kept_count_starts[chain + 1]],
            chains.kept_token_ids[chains.kept_id_starts[chain] : chains.kept_id_starts[chain + 1]],
        ),
    }


def columns_of(
    batch_id: str, rollouts: Sequence[VerifiedRollout], sampling: SamplingSettings = UNTRUNCATED
) -> VerifiedRollouts:
    """Synthetic verdicts as finalization holds them, sampled with ``sampling``; each weight span must cover its
    call's tokens."""
    linearized = [v for v in rollouts if v.linearized]
    for v in linearized:
        ends = np.cumsum([c.carry_len + c.gen_len for c in v.call_spans]).tolist()
        expected = [(c.call_id, end - c.carry_len - c.gen_len, end) for c, end in zip(v.call_spans, ends, strict=True)]
        assert [(w.call_id, w.start, w.end) for w in v.weight_spans] == expected, v.rollout_id
    spans = [c for v in linearized for c in v.call_spans]
    chain = np.full(len(rollouts), -1, np.int64)
    chain[[i for i, v in enumerate(rollouts) if v.linearized]] = np.arange(len(linearized))
    return VerifiedRollouts(
        batch_id=batch_id,
        group_ids=[v.group_id for v in rollouts],
        rollout_ids=[v.rollout_id for v in rollouts],
        rewards=[v.reward for v in rollouts],
        reasons=[v.reason for v in rollouts],
        terminal_selections=[v.terminal_selection for v in rollouts],
        epoch_span_counts=np.array([v.epoch_span_count for v in rollouts], np.int64),
        chain=chain,
        chain_counts=(chain >= 0).astype(np.int64),
        linearized=Linearized(
            input_ids=np.concatenate([np.zeros(0, np.int32), *(v.input_ids for v in linearized)]),
            loss_mask=np.concatenate([np.zeros(0, np.uint8), *(v.loss_mask for v in linearized)]),
            logprobs=np.concatenate([np.zeros(0, np.float32), *(v.logprobs for v in linearized)]),
            token_starts=offsets([v.input_ids.size for v in linearized]),
            call_ids=pa.array([c.call_id for c in spans], pa.string()),
            carry_len=np.array([c.carry_len for c in spans], np.int64),
            gen_len=np.array([c.gen_len for c in spans], np.int64),
            weight_version=np.array([w.weight_version for v in linearized for w in v.weight_spans], np.uint64),
            extras_json=pa.array(
                [text for v in linearized for text in v.extras_json or ("null",) * len(v.call_spans)], pa.string()
            ),
            call_starts=offsets([len(v.call_spans) for v in linearized]),
            truncated=np.array([v.truncated for v in linearized], bool),
            kept_counts=np.concatenate([np.zeros(0, np.int32), *(v.kept.counts for v in linearized)]),
            kept_token_ids=np.concatenate([np.zeros(0, np.int32), *(v.kept.token_ids for v in linearized)]),
            kept_count_starts=offsets([v.kept.counts.size for v in linearized]),
            kept_id_starts=offsets([v.kept.token_ids.size for v in linearized]),
        ),
        sampling=sampling,
    )
