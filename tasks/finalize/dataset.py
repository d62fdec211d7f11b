"""GRPO dataset rows (ARCHITECTURE 4.6) and their assembly, group by group (section 8).

:class:`DatasetRow` is the contract between finalization and the trainer: one Arrow schema,
derived from the record, and invariants checked on construction (so a row read back is as
trustworthy as a row written). :func:`assemble_rows` turns the verified rollouts of planned
groups (a shard's, as columns) into one table of rows, built column by column so that every row
satisfies those invariants by construction: with ``on_invalid = "mask"`` exactly one row per
planned rollout (invalid and missing ones masked, advantage 0), with ``"drop"`` only the valid
ones. Advantages are computed per group over its valid rows only; a masked row never carries a
nonzero advantage. :func:`assemble_group` does the same for the rollout objects of one group.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa

from tasks.capture.records import TERMINAL_SELECTIONS, check_reason
from tasks.config import ADVANTAGES, ON_INVALID
from tasks.finalize import reasons
from tasks.finalize.advantages import group_advantages
from tasks.finalize.runs import offsets
from tasks.finalize.verified import CallSpan, VerifiedRollout, VerifiedRollouts, WeightSpan
from tasks.ids import check_id
from tasks.schema import ArrowRecord, column

DATASET_SCHEMA_VERSION = 1

WEIGHT_SPAN_TYPE = pa.struct(
    [("call_id", pa.string()), ("start", pa.int64()), ("end", pa.int64()), ("weight_version", pa.uint64())]
)
CALL_SPAN_TYPE = pa.struct([("call_id", pa.string()), ("carry_len", pa.int64()), ("gen_len", pa.int64())])


# What each column means, for the dataset card and the docs (the types come from the schema).
COLUMN_DESCRIPTIONS: dict[str, str] = {
    "batch_id": "the batch this row belongs to",
    "group_id": "the task: rows of one group share a prompt and are normalized together",
    "rollout_id": "the rollout (task index and sample index in the group)",
    "input_ids": "token ids root→terminal call: each call's carried prompt tokens, then its sampled tokens",
    "loss_mask": "1 on tokens the model sampled, 0 on carried prompt/environment tokens",
    "logprobs": "logprob of each sampled token as sampled (after temperature/top-p/top-k); 0 where loss_mask is 0",
    "prompt_len": "carried tokens of the root call (the initial prompt)",
    "reward": "the environment's reward of the rollout (null when none was recorded)",
    "advantage": "group-relative advantage of the row (0 when masked, or when the group has no signal)",
    "group_size": "rollouts planned per group",
    "sample_mask": "1 trainable, 0 masked (never train on a masked row)",
    "mask_reason": "why the row is masked (a stable reason name), null when trainable",
    "weight_version_min": "lowest weight version of the calls on the chain (null without tokens)",
    "weight_version_max": "highest weight version of the calls on the chain (null without tokens)",
    "weight_version_spans": "per call: token range [start, end) and the weight version it was admitted at",
    "call_spans": "per call, in order: carried tokens (carry_len) then sampled tokens (gen_len)",
    "truncated": "the terminal call stopped on the length limit",
    "num_turns": "model calls on the chain root→terminal",
    "terminal_selection": "how the terminal call was selected: declared, response_id, content or heuristic",
}


class InvalidDatasetRowError(ValueError):
    """A dataset row breaks an invariant of ARCHITECTURE 4.6; the message names the rollout and field."""


@dataclass(frozen=True, eq=False)
class DatasetRow(ArrowRecord):
    """One GRPO training row: a linearized rollout root→terminal, or a masked placeholder.

    Invariants: the three token lists have equal length; ``loss_mask`` is 0 on each call's
    carried tokens and 1 on its sampled tokens, as ``call_spans`` says; ``logprobs`` are finite
    and exactly 0 where the mask is 0; weight spans are one per call, in order, inside that
    call's tokens, and ``weight_version_min``/``max`` summarize them (null without tokens).
    ``sample_mask`` 1 ⇔ ``mask_reason`` null; a trainable row has tokens, a sampled token, a
    reward and a terminal selection; a masked row has advantage exactly 0.
    """

    batch_id: str = column(pa.string())
    group_id: str = column(pa.string())
    rollout_id: str = column(pa.string())
    input_ids: np.ndarray = column(pa.list_(pa.int32()))
    loss_mask: np.ndarray = column(pa.list_(pa.uint8()))
    logprobs: np.ndarray = column(pa.list_(pa.float32()))
    prompt_len: int = column(pa.int64())
    reward: float | None = column(pa.float64(), nullable=True)
    advantage: float = column(pa.float64())
    group_size: int = column(pa.int32())
    sample_mask: int = column(pa.uint8())
    mask_reason: str | None = column(pa.string(), nullable=True)
    weight_version_min: int | None = column(pa.uint64(), nullable=True)
    weight_version_max: int | None = column(pa.uint64(), nullable=True)
    weight_version_spans: tuple[WeightSpan, ...] = column(pa.list_(WEIGHT_SPAN_TYPE), item=WeightSpan)
    call_spans: tuple[CallSpan, ...] = column(pa.list_(CALL_SPAN_TYPE), item=CallSpan)
    truncated: bool = column(pa.bool_())
    num_turns: int = column(pa.int32())
    terminal_selection: str | None = column(pa.string(), nullable=True)

    def __post_init__(self) -> None:
        for name in ("batch_id", "group_id", "rollout_id"):
            check_id(getattr(self, name), field=name)
        for name, dtype in (("input_ids", np.int32), ("loss_mask", np.uint8), ("logprobs", np.float32)):
            object.__setattr__(self, name, self._array(name, dtype))
        for name in ("weight_version_spans", "call_spans"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        self._check_scalars()
        self._check_tokens()
        self._check_spans()
        self._check_sample_mask()

    def _fail(self, message: str) -> InvalidDatasetRowError:
        return InvalidDatasetRowError(f"dataset row {self.rollout_id}: {message}")

    def _array(self, name: str, dtype: type) -> np.ndarray:
        value = getattr(self, name)
        if isinstance(value, np.ndarray):
            if value.dtype != dtype or value.ndim != 1:
                raise self._fail(f"{name} must be a 1-d {np.dtype(dtype)} array, got {value.ndim}-d {value.dtype}")
            if value.flags.writeable:
                value = value.copy()
                value.flags.writeable = False
            return value
        try:
            array = np.array(value, dtype=dtype)
        except (TypeError, ValueError, OverflowError) as exc:
            raise self._fail(f"{name} is not a list of {np.dtype(dtype)}: {exc}") from None
        if array.ndim != 1:
            raise self._fail(f"{name} must be one-dimensional, got shape {array.shape}")
        array.flags.writeable = False
        return array

    def _check_scalars(self) -> None:
        _check_int(self, "prompt_len", 0)
        _check_int(self, "group_size", 1)
        _check_int(self, "num_turns", 0)
        _check_int(self, "sample_mask", 0)
        if self.reward is not None and not _finite_number(self.reward):
            raise self._fail(f"reward must be a finite number or null, got {self.reward!r}")
        if not _finite_number(self.advantage):
            raise self._fail(f"advantage must be a finite number, got {self.advantage!r}")
        if not isinstance(self.truncated, bool):
            raise self._fail(f"truncated must be a bool, got {self.truncated!r}")
        if self.terminal_selection is not None and self.terminal_selection not in TERMINAL_SELECTIONS:
            raise self._fail(f"terminal_selection must be one of {TERMINAL_SELECTIONS} or null")

    def _check_tokens(self) -> None:
        ids, mask, logprobs = self.input_ids, self.loss_mask, self.logprobs
        if not ids.size == mask.size == logprobs.size:
            raise self._fail(
                f"input_ids ({ids.size}), loss_mask ({mask.size}) and logprobs ({logprobs.size}) differ in length"
            )
        if (ids < 0).any():
            raise self._fail("input_ids holds a negative token id")
        if (mask > 1).any():
            raise self._fail("loss_mask holds a value other than 0 or 1")
        if not np.isfinite(logprobs).all():
            raise self._fail("logprobs holds a non-finite value")
        if (logprobs[mask == 0] != 0).any():
            raise self._fail("logprobs is not 0 where loss_mask is 0")
        if self.prompt_len > ids.size:
            raise self._fail(f"prompt_len {self.prompt_len} exceeds the {ids.size} tokens of the row")

    def _check_spans(self) -> None:
        calls, spans = self.call_spans, self.weight_version_spans
        if not all(isinstance(c, CallSpan) for c in calls) or not all(isinstance(s, WeightSpan) for s in spans):
            raise self._fail("call_spans must hold CallSpan and weight_version_spans WeightSpan items")
        if len(calls) != self.num_turns:
            raise self._fail(f"num_turns {self.num_turns} differs from the {len(calls)} call spans")
        if self.input_ids.size == 0:
            if calls or spans or self.prompt_len or self.truncated:
                raise self._fail("a row without tokens has no call spans, weight spans, prompt_len or truncation")
            if self.weight_version_min is not None or self.weight_version_max is not None:
                raise self._fail("a row without tokens has null weight_version_min/max")
            return
        carry = np.array([c.carry_len for c in calls], dtype=np.int64)
        gen = np.array([c.gen_len for c in calls], dtype=np.int64)
        if not calls or (carry < 0).any() or (gen < 0).any():
            raise self._fail("a row with tokens needs call spans with carry_len and gen_len >= 0")
        if int(carry.sum() + gen.sum()) != self.input_ids.size:
            raise self._fail(
                f"call spans cover {int(carry.sum() + gen.sum())} tokens, the row has {self.input_ids.size}"
            )
        if self.prompt_len != carry[0]:
            raise self._fail(f"prompt_len {self.prompt_len} differs from the root call's carry_len {carry[0]}")
        lengths = np.empty(2 * len(calls), dtype=np.int64)
        lengths[0::2], lengths[1::2] = carry, gen
        expected = np.repeat(np.arange(lengths.size, dtype=np.uint8) & 1, lengths)  # per call: 0s, then 1s
        if not np.array_equal(expected, self.loss_mask):
            raise self._fail("loss_mask does not follow call_spans (each call: carried 0s, then sampled 1s)")
        if [s.call_id for s in spans] != [c.call_id for c in calls]:
            raise self._fail("weight_version_spans must name the calls of call_spans, one each, in order")
        ends = np.cumsum(carry + gen)
        for span, lo, hi in zip(spans, (ends - carry - gen).tolist(), ends.tolist(), strict=True):
            if not lo <= span.start < span.end <= hi:
                raise self._fail(f"weight span of {span.call_id} [{span.start}, {span.end}) is outside [{lo}, {hi})")
        versions = [s.weight_version for s in spans]
        if (self.weight_version_min, self.weight_version_max) != (min(versions), max(versions)):
            raise self._fail(
                f"weight_version_min/max ({self.weight_version_min}, {self.weight_version_max}) differ from "
                f"the spans' ({min(versions)}, {max(versions)})"
            )

    def _check_sample_mask(self) -> None:
        if self.sample_mask == 1:
            if self.mask_reason is not None:
                raise self._fail(f"a trainable row (sample_mask 1) has mask_reason {self.mask_reason!r}")
            if self.reward is None or self.terminal_selection is None or not self.loss_mask.any():
                raise self._fail("a trainable row needs a reward, a terminal selection and a sampled token")
        elif self.sample_mask == 0:
            if self.mask_reason is None:
                raise self._fail("a masked row (sample_mask 0) needs a mask_reason")
            check_reason(self.mask_reason, field="mask_reason")
            if self.advantage != 0:
                raise self._fail(f"a masked row has advantage {self.advantage}, expected 0")
        else:
            raise self._fail(f"sample_mask must be 0 or 1, got {self.sample_mask!r}")


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(row: DatasetRow, name: str, minimum: int) -> None:
    value = getattr(row, name)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise row._fail(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class GroupStats:
    """What assembling one group found.

    ``planned`` rollouts; ``valid`` of them trainable, ``missing`` without a receipt;
    ``invalid_reasons`` counts the reason of every non-trainable planned rollout (missing ones
    as ``missing_receipt``); ``rows`` written; ``advantage_outcome`` is one of
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

    ``table`` has the :class:`DatasetRow` schema, rows ordered by group id then rollout id and
    built column-wise so that every row satisfies :class:`DatasetRow`'s invariants by
    construction (:attr:`rows` proves it record by record). ``groups`` has each group's stats
    in table order; ``receipts``, ``epoch_span_count`` and ``terminal_selections`` (method ->
    count, ``none`` without one) describe the verified rollouts the rows were built from.
    """

    table: pa.Table
    groups: tuple[GroupStats, ...]
    receipts: int
    epoch_span_count: int
    terminal_selections: tuple[tuple[str, int], ...]

    @cached_property
    def rows(self) -> tuple[DatasetRow, ...]:
        """The rows as records, each checked against every invariant of :class:`DatasetRow`."""
        return tuple(DatasetRow.from_table(self.table))


@dataclass(frozen=True)
class GroupResult(AssembledRows):
    """The assembled rows of one group (:func:`assemble_group`)."""

    @property
    def stats(self) -> GroupStats:
        return self.groups[0]


def assemble_group(
    verified: Sequence[VerifiedRollout],
    *,
    batch_id: str,
    group_id: str,
    planned_rollout_ids: Sequence[str],
    on_invalid: str = "mask",
    advantage: str = "grpo",
) -> GroupResult:
    """Rows of one planned group from its verified rollouts (at most one per planned rollout).

    ``planned_rollout_ids`` are the group's rollouts from the plan; see :func:`assemble_rows`.
    """
    assembled = assemble_rows(
        VerifiedRollouts.of(batch_id, verified),
        batch_id=batch_id,
        planned={group_id: planned_rollout_ids},
        on_invalid=on_invalid,
        advantage=advantage,
    )
    return GroupResult(**{f.name: getattr(assembled, f.name) for f in dataclasses.fields(assembled)})


def assemble_rows(
    verified: VerifiedRollouts,
    *,
    batch_id: str,
    planned: Mapping[str, Sequence[str]],
    on_invalid: str = "mask",
    advantage: str = "grpo",
) -> AssembledRows:
    """Rows of planned groups (group id -> its planned rollout ids) from their verified rollouts.

    ``group_size`` is the number of a group's planned rollouts. With ``on_invalid = "mask"``
    every planned rollout gets a row, without a verified rollout it is invalid with reason
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
    rows = _RowsBuilder(verified)
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
            rows.add(entry, group_id, rollout_id, len(ids), advantage_of.get(rollout_id, 0.0), reason)
            kept += 1
        chains = [int(verified.chain[e]) for e in valid]
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

    def __init__(self, verified: VerifiedRollouts) -> None:
        self.verified = verified
        self.entries: list[int] = []
        self.fields: tuple[list, ...] = ([], [], [], [], [])

    def add(
        self, entry: int | None, group_id: str, rollout_id: str, group_size: int, advantage: float, reason: str | None
    ) -> None:
        """A row of ``entry`` (None: a planned rollout without a verified rollout)."""
        self.entries.append(-1 if entry is None else entry)
        values = (group_id, rollout_id, group_size, advantage if reason is None else 0.0, reason)
        for cells, value in zip(self.fields, values, strict=True):
            cells.append(value)

    def table(self) -> pa.Table:
        verified = self.verified
        group_ids, rollout_ids, group_sizes, advantages, mask_reasons = self.fields
        entries = np.array(self.entries, np.int64)
        n = entries.size
        chain = np.full(n, -1, np.int64)
        chain[entries >= 0] = verified.chain[entries[entries >= 0]]
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
            "call_spans": _struct_lists(
                call_counts, CALL_SPAN_TYPE, [tokens.call_ids, pa.array(tokens.carry_len), pa.array(tokens.gen_len)]
            ),
            "truncated": pa.array(truncated, pa.bool_()),
            "num_turns": pa.array(call_counts, pa.int32()),
            "terminal_selection": pa.array(
                [verified.terminal_selections[e] if e is not None else None for e in ids_of], pa.string()
            ),
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
