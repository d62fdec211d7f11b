"""Dataset rows of planned groups from their verified rollouts, group by group (docs/architecture.md §8).

:func:`assemble_rows` turns the verified rollouts of planned groups (a shard's, as columns) into
one table of :class:`~tasks.records.dataset_row.DatasetRow` rows, built column by column so
that every row satisfies the row's invariants by construction: a row per chain of a planned
rollout (one root→terminal; one per call under independent calls, each with the rollout's reward
and advantage) and one row without tokens for a rollout without chains. With
``on_invalid = "mask"`` every planned rollout has rows (invalid and missing ones masked,
advantage 0), with ``"drop"`` only the valid ones. Advantages are computed per group over its valid rows only
(:mod:`tasks.finalize.advantages`); a masked row never carries a nonzero advantage. Each row names
the weights of every version that sampled its tokens, judged from its calls' extras and the plan
(:func:`tasks.finalize.weights.row_weights`). Each row carries the sampling settings its calls were
proven to share with the batch config (a call that differs fails its chain, ``wrong_<field>``) and,
when they truncate, its calls' kept sets concatenated root→terminal: one per sampled token, in order
(a truncating call without them fails its chain, ``sampling_mask_missing``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from tasks.batch_fields import ADVANTAGES, ON_INVALID
from tasks.finalize import reasons
from tasks.finalize.advantages import group_advantages
from tasks.finalize.ragged import offsets, owners
from tasks.finalize.verify.verdicts import VerifiedRollouts
from tasks.finalize.weights import PlannedWeights, row_weights
from tasks.records.dataset_row import CALL_SPAN_TYPE, VERSION_WEIGHTS_TYPE, WEIGHT_SPAN_TYPE, DatasetRow


@dataclass(frozen=True)
class GroupStats:
    """What assembling one group found.

    ``planned`` rollouts; ``valid`` of them trainable, ``missing`` without a receipt;
    ``invalid_reasons`` counts the reason of every non-trainable planned rollout (missing ones
    as ``missing_receipt``); ``rows`` written (more than the rollouts under independent calls);
    ``advantage_outcome`` is one of
    :data:`tasks.finalize.advantages.OUTCOMES` (``no_valid``: the group trains on nothing);
    ``weight_version`` is the minimum over valid rows (None without valid rows).
    """

    group_id: str
    planned: int
    valid: int
    missing: int
    rows: int
    advantage_outcome: str
    weight_version: int | None
    invalid_reasons: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class AssembledRows:
    """The rows of consecutive planned groups as one table, and what assembling them found.

    ``table`` has the :class:`DatasetRow` schema, rows ordered by group id, rollout id, then call and
    built column-wise so that every row satisfies :class:`DatasetRow`'s invariants by
    construction (``DatasetRow.from_table`` proves it record by record). ``groups`` has each group's stats
    in table order; ``receipts``, ``epoch_span_count`` and ``terminal_selections`` (method ->
    count, ``none`` without one) describe the verified rollouts the rows were built from.
    """

    table: pa.Table
    groups: tuple[GroupStats, ...]
    receipts: int
    epoch_span_count: int
    terminal_selections: tuple[tuple[str, int], ...]


def assemble_rows(
    verified: VerifiedRollouts,
    *,
    batch_id: str,
    planned: Mapping[str, Sequence[str]],
    weights: PlannedWeights,
    on_invalid: str = "mask",
    advantage: str = "grpo",
) -> AssembledRows:
    """Rows of planned groups (group id -> its planned rollout ids) from their verified rollouts.

    ``weights`` are the plan's (:meth:`PlannedWeights.of_plan`): what a call that names no weights
    had at the planned version.

    ``group_size`` is the number of a group's planned rollouts. With ``on_invalid = "mask"``
    every planned rollout gets its rows, without a verified rollout it is invalid with reason
    ``missing_receipt``; with ``"drop"`` only valid rollouts do. Advantages are computed per
    group over its valid rows only. Raises ValueError when a verified rollout is of another
    batch or of an unplanned group, not planned in its group, or given twice: those are caller
    bugs, not data.
    """
    if on_invalid not in ON_INVALID:
        raise ValueError(f"on_invalid must be one of {list(ON_INVALID)}, got {on_invalid!r}")
    if advantage not in ADVANTAGES:
        raise ValueError(f"advantage must be one of {list(ADVANTAGES)}, got {advantage!r}")
    groups = {group_id: sorted(ids) for group_id, ids in sorted(planned.items())}
    for group_id, ids in groups.items():
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"group {group_id}: planned rollout ids must be non-empty and distinct, got {ids}")
    entry_of = _entries_by_rollout(verified, batch_id, groups)
    versions = _per_chain(np.minimum, verified.linearized.weight_version, verified.linearized.call_starts)
    chains_of = [range(c, c + n) for c, n in zip(verified.chain.tolist(), verified.chain_counts.tolist(), strict=True)]
    rows = _RowsBuilder(verified, weights)
    stats = []
    for group_id, ids in groups.items():
        entries = [entry_of.get(rollout_id) for rollout_id in ids]
        valid = [e for e in entries if e is not None and verified.reasons[e] is None]
        computed = group_advantages([verified.rewards[e] for e in valid], advantage)
        advantage_of = {verified.rollout_ids[e]: a for e, a in zip(valid, computed.values.tolist(), strict=True)}
        invalid: Counter[str] = Counter()
        kept = 0
        for rollout_id, entry in zip(ids, entries, strict=True):
            reason = reasons.MISSING_RECEIPT if entry is None else verified.reasons[entry]
            if reason is not None:
                invalid[reason] += 1
                if on_invalid == "drop":
                    continue
            for chain in chains_of[entry] if entry is not None and chains_of[entry] else (-1,):
                rows.add(entry, chain, group_id, rollout_id, len(ids), advantage_of.get(rollout_id, 0.0), reason)
                kept += 1
        chains = [c for e in valid for c in chains_of[e]]
        stats.append(
            GroupStats(
                group_id=group_id,
                planned=len(ids),
                valid=len(valid),
                missing=entries.count(None),
                rows=kept,
                advantage_outcome=computed.outcome,
                weight_version=min((int(versions[c]) for c in chains), default=None),
                invalid_reasons=tuple(sorted(invalid.items())),
            )
        )
    # Receipts actually read: a planned rollout without one has a verdict (missing_receipt) but no receipt.
    given = sorted(e for e in entry_of.values() if verified.reasons[e] != reasons.MISSING_RECEIPT)
    selections = Counter(verified.terminal_selections[e] or "none" for e in given)
    return AssembledRows(
        table=rows.table(),
        groups=tuple(stats),
        receipts=len(given),
        epoch_span_count=int(verified.epoch_span_counts[given].sum()),
        terminal_selections=tuple(sorted(selections.items())),
    )


def _entries_by_rollout(
    verified: VerifiedRollouts, batch_id: str, groups: Mapping[str, Sequence[str]]
) -> dict[str, int]:
    """rollout id -> its entry in ``verified``, after the caller-bug checks of :func:`assemble_rows`."""
    planned = {group_id: set(ids) for group_id, ids in groups.items()}
    entry_of: dict[str, int] = {}
    for entry, (rollout_id, group_id) in enumerate(zip(verified.rollout_ids, verified.group_ids, strict=True)):
        where = f"verified rollout {rollout_id}"
        if verified.batch_id != batch_id or group_id not in planned:
            raise ValueError(
                f"{where} is of batch {verified.batch_id} group {group_id}, not {batch_id} {' '.join(planned)}"
            )
        if rollout_id not in planned[group_id]:
            raise ValueError(f"{where} is not planned in group {group_id}")
        if rollout_id in entry_of:
            raise ValueError(f"{where} is given twice")
        entry_of[rollout_id] = entry
    return entry_of


def _per_chain(reduce: np.ufunc, values: np.ndarray, call_starts: np.ndarray) -> np.ndarray:
    """``reduce`` over each chain's calls (every chain has at least one call)."""
    return reduce.reduceat(values, call_starts[:-1]) if call_starts.size > 1 else values[:0]


class _RowsBuilder:
    """Dataset rows added one by one (Python per row: scalars only), built into one table column by column."""

    def __init__(self, verified: VerifiedRollouts, weights: PlannedWeights) -> None:
        self.verified = verified
        self.weights = weights
        self.entries: list[int] = []
        self.chains: list[int] = []
        self.fields: tuple[list, ...] = ([], [], [], [], [])

    def add(
        self,
        entry: int | None,
        chain: int,
        group_id: str,
        rollout_id: str,
        group_size: int,
        advantage: float,
        reason: str | None,
    ) -> None:
        """A row of ``entry`` (None: a planned rollout without a verified rollout) over ``chain`` (-1: no tokens)."""
        self.entries.append(-1 if entry is None else entry)
        self.chains.append(chain)
        values = (group_id, rollout_id, group_size, advantage if reason is None else 0.0, reason)
        for cells, value in zip(self.fields, values, strict=True):
            cells.append(value)

    def table(self) -> pa.Table:
        verified = self.verified
        group_ids, rollout_ids, group_sizes, advantages, mask_reasons = self.fields
        chain = np.array(self.chains, np.int64)
        n = chain.size
        linearized = chain >= 0  # rows that keep their rollout's verified tokens
        tokens = verified.linearized.take(chain[linearized])
        ids_of = [e if e >= 0 else None for e in self.entries]
        call_counts = np.zeros(n, np.int64)
        call_counts[linearized] = np.diff(tokens.call_starts)
        token_counts = np.zeros(n, np.int64)
        token_counts[linearized] = np.diff(tokens.token_starts)
        versions_min = _per_row(linearized, _per_chain(np.minimum, tokens.weight_version, tokens.call_starts))
        versions_max = _per_row(linearized, _per_chain(np.maximum, tokens.weight_version, tokens.call_starts))
        prompt_len = np.zeros(n, np.int64)
        prompt_len[linearized] = tokens.carry_len[tokens.call_starts[:-1]]
        truncated = np.zeros(n, bool)
        truncated[linearized] = tokens.truncated
        call_tokens = tokens.carry_len + tokens.gen_len
        ends = np.cumsum(call_tokens) - np.repeat(tokens.token_starts[:-1], np.diff(tokens.call_starts))
        named = row_weights(
            self.weights, owners(tokens.call_starts), tokens.weight_version, tokens.extras_json, len(tokens)
        )
        weights_counts = np.zeros(n, np.int64)
        weights_counts[linearized] = np.diff(named.starts)
        kept_counts = np.zeros(n, np.int64)
        kept_counts[linearized] = np.diff(tokens.kept_count_starts)
        kept_ids = np.zeros(n, np.int64)
        kept_ids[linearized] = np.diff(tokens.kept_id_starts)
        sampling = verified.sampling
        columns = {
            "batch_id": pa.array([verified.batch_id] * n, pa.string()),
            "group_id": pa.array(group_ids, pa.string()),
            "rollout_id": pa.array(rollout_ids, pa.string()),
            "input_ids": _lists(token_counts, tokens.input_ids, pa.int32()),
            "loss_mask": _lists(token_counts, tokens.loss_mask, pa.uint8()),
            "logprobs": _lists(token_counts, tokens.logprobs, pa.float32()),
            "prompt_len": pa.array(prompt_len, pa.int64()),
            "reward": pa.array([verified.rewards[e] if e is not None else None for e in ids_of], pa.float64()),
            "advantage": pa.array(advantages, pa.float64()),
            "group_size": pa.array(group_sizes, pa.int32()),
            "sample_mask": pa.array([int(reason is None) for reason in mask_reasons], pa.uint8()),
            "mask_reason": pa.array(mask_reasons, pa.string()),
            "weight_version_min": versions_min,
            "weight_version_max": versions_max,
            "weight_version_spans": _struct_lists(
                call_counts,
                WEIGHT_SPAN_TYPE,
                [tokens.call_ids, pa.array(ends - call_tokens), pa.array(ends), pa.array(tokens.weight_version)],
            ),
            "weights_by_version": _struct_lists(weights_counts, VERSION_WEIGHTS_TYPE, [named.versions, named.sha256]),
            "call_spans": _struct_lists(
                call_counts, CALL_SPAN_TYPE, [tokens.call_ids, pa.array(tokens.carry_len), pa.array(tokens.gen_len)]
            ),
            "truncated": pa.array(truncated, pa.bool_()),
            "num_turns": pa.array(call_counts, pa.int32()),
            "terminal_selection": pa.array(
                [verified.terminal_selections[e] if e is not None else None for e in ids_of], pa.string()
            ),
            "temperature": pa.array(np.full(n, sampling.temperature), pa.float64()),
            "top_p": pa.array(np.full(n, sampling.top_p), pa.float64()),
            "top_k": pa.array(np.full(n, sampling.top_k), pa.int32()),
            "logprobs_mode": pa.array([sampling.logprobs_mode] * n, pa.string()),
            "kept_counts": _lists(kept_counts, tokens.kept_counts, pa.int32()),
            "kept_token_ids": _lists(kept_ids, tokens.kept_token_ids, pa.int32()),
        }
        return pa.Table.from_arrays(list(columns.values()), schema=DatasetRow.arrow_schema())


def _per_row(present: np.ndarray, values: np.ndarray) -> pa.Array:
    """A nullable uint64 column: ``values`` on the rows where ``present``, null elsewhere."""
    out = np.zeros(present.size, np.uint64)
    out[present] = values
    return pa.array(out, pa.uint64(), mask=~present)


def _lists(counts: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    """A list column: row ``i`` holds the next ``counts[i]`` of ``values``."""
    starts = offsets(counts)
    if starts[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"{starts[-1]} values exceed one list column's 32-bit offsets; assemble fewer groups at once")
    return pa.ListArray.from_arrays(pa.array(starts.astype(np.int32)), pa.array(values, value_type))


def _struct_lists(counts: np.ndarray, struct_type: pa.StructType, children: list[pa.Array]) -> pa.Array:
    """A list<struct> column: row ``i`` holds the next ``counts[i]`` structs of the child columns."""
    fields = list(struct_type)
    children = [child.cast(f.type) for child, f in zip(children, fields, strict=True)]
    return _lists(counts, pa.StructArray.from_arrays(children, fields=fields), struct_type)
