"""The GRPO dataset row (docs/architecture.md §4.6): the contract between finalization and the trainer, written once.

:class:`DatasetRow` declares every column with its Arrow type (:meth:`DatasetRow.arrow_schema` is
the schema of every dataset part) and checks its invariants on construction, so a row read back
is as trustworthy as a row written. :data:`COLUMN_DESCRIPTIONS` says what each column means, for
the dataset card and the docs. :func:`upgrade_rows` reads a table of an older schema version as
the current one; every reader of dataset parts calls it.

Every row says how its tokens were sampled (``temperature``, ``top_p``, ``top_k``,
``logprobs_mode``) and, when that sampling truncates (top-p / top-k, :func:`tasks.sampling.truncates`),
the sampling mask over its sampled tokens (``kept_counts``, ``kept_token_ids``: one kept set per
position where ``loss_mask`` is 1, in order, as :class:`~tasks.records.sampling_mask.KeptSets` holds
them), so a trainer renormalizes over the sets the sampler drew from. Rows of schema 1 and 2 never
recorded their sampling: they read with the four sampling columns null ("not recorded") and no kept
sets, never a mask they do not have.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.checks import check_choice, check_finite, check_int, check_reason, is_hex_digest
from tasks.ids import check_id
from tasks.records.ledger import TERMINAL_SELECTIONS
from tasks.records.sampling_mask import KeptSets
from tasks.sampling import SamplingSettings, truncates
from tasks.schema import ArrowRecord, column

# 2: weights_by_version; 3: the sampling columns and kept sets (older versions are read as 3 by upgrade_rows)
DATASET_SCHEMA_VERSION = 3
READABLE_DATASET_SCHEMA_VERSIONS = (1, 2, 3)
SAMPLING_COLUMNS = ("temperature", "top_p", "top_k", "logprobs_mode")
KEPT_COLUMNS = ("kept_counts", "kept_token_ids")


@dataclass(frozen=True)
class CallSpan:
    """One call of the linearized chain: its carried prompt tokens, then its sampled tokens."""

    call_id: str = column(pa.string())
    carry_len: int = column(pa.int64())
    gen_len: int = column(pa.int64())


@dataclass(frozen=True)
class WeightSpan:
    """Tokens ``[start, end)`` of the row were produced by a call admitted at ``weight_version``."""

    call_id: str = column(pa.string())
    start: int = column(pa.int64())
    end: int = column(pa.int64())
    weight_version: int = column(pa.uint64())


@dataclass(frozen=True)
class VersionWeights:
    """The weights that sampled a row's tokens of ``weight_version``: their sha256, or None (declared, not verified)."""

    weight_version: int = column(pa.uint64())
    weights_sha256: str | None = column(pa.string(), nullable=True)


def _struct_type(item: type) -> pa.StructType:
    """The Arrow struct of a span dataclass: its fields, with the types they declare."""
    return pa.struct([(f.name, f.metadata["arrow"]) for f in dataclasses.fields(item)])


CALL_SPAN_TYPE = _struct_type(CallSpan)
WEIGHT_SPAN_TYPE = _struct_type(WeightSpan)
VERSION_WEIGHTS_TYPE = _struct_type(VersionWeights)


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
    "weights_by_version": "per weight version that sampled a token of the row, ascending: the sha256 of its weights "
    "where every call of the row naming that version names that one sha256, else null (declared, not verified)",
    "call_spans": "per call, in order: carried tokens (carry_len) then sampled tokens (gen_len)",
    "truncated": "the terminal call stopped on the length limit",
    "num_turns": "model calls on the chain root→terminal",
    "terminal_selection": "how the terminal call was selected: declared, response_id, content or heuristic",
    "temperature": "the temperature every call of the row sampled with (the batch's; null: not recorded, "
    "a row of schema 1 or 2)",
    "top_p": "the top-p every call of the row sampled with (1.0: off; null: not recorded)",
    "top_k": "the top-k every call of the row sampled with (-1: off; null: not recorded)",
    "logprobs_mode": "what logprobs holds: processed = after temperature/top-p/top-k (null: not recorded)",
    "kept_counts": "the sampling mask: per position where loss_mask is 1, in order, how many token ids its sampler "
    "kept (top-p/top-k); empty when the row's sampling does not truncate, it has no sampled token, or its sampling "
    "is not recorded",
    "kept_token_ids": "the kept ids of every sampled token one after another (kept_counts[i] of them for the i-th, "
    "ascending, the sampled token among them)",
}


class InvalidDatasetRowError(ValueError):
    """A dataset row breaks an invariant of docs/architecture.md §4.6; the message names the rollout and field."""


@dataclass(frozen=True, eq=False)
class DatasetRow(ArrowRecord):
    """One GRPO training row: a linearized rollout root→terminal, or a masked placeholder.

    Invariants: the three token lists have equal length; ``loss_mask`` is 0 on each call's
    carried tokens and 1 on its sampled tokens, as ``call_spans`` says; ``logprobs`` are finite
    and exactly 0 where the mask is 0; weight spans are one per call, in order, inside that
    call's tokens, and ``weight_version_min``/``max`` summarize them (null without tokens);
    ``weights_by_version`` names each version at most once, ascending, every version of the spans
    among them, each with a sha256 (64 lowercase hex digits) or None, and is empty exactly without tokens.
    ``sample_mask`` 1 ⇔ ``mask_reason`` null; a trainable row has tokens, a sampled token, a
    reward and a terminal selection; a masked row has advantage exactly 0. The four sampling
    columns are all null (not recorded: a row of schema 1 or 2) or all set to settings a batch
    may sample with (:class:`~tasks.sampling.SamplingSettings`); the kept sets are present
    exactly when the sampling is recorded and truncates and the row has a sampled token, and then
    hold one set per sampled token with that token in it (:meth:`KeptSets.check`).
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
    weights_by_version: tuple[VersionWeights, ...] = column(pa.list_(VERSION_WEIGHTS_TYPE), item=VersionWeights)
    call_spans: tuple[CallSpan, ...] = column(pa.list_(CALL_SPAN_TYPE), item=CallSpan)
    truncated: bool = column(pa.bool_())
    num_turns: int = column(pa.int32())
    terminal_selection: str | None = column(pa.string(), nullable=True)
    temperature: float | None = column(pa.float64(), nullable=True)
    top_p: float | None = column(pa.float64(), nullable=True)
    top_k: int | None = column(pa.int32(), nullable=True)
    logprobs_mode: str | None = column(pa.string(), nullable=True)
    kept_counts: np.ndarray = column(pa.list_(pa.int32()))
    kept_token_ids: np.ndarray = column(pa.list_(pa.int32()))

    def __post_init__(self) -> None:
        for name in ("batch_id", "group_id", "rollout_id"):
            check_id(getattr(self, name), field=name)
        for name, dtype in (
            ("input_ids", np.int32),
            ("loss_mask", np.uint8),
            ("logprobs", np.float32),
            ("kept_counts", np.int32),
            ("kept_token_ids", np.int32),
        ):
            object.__setattr__(self, name, self._array(name, dtype))
        for name in ("weight_version_spans", "weights_by_version", "call_spans"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        self._check_scalars()
        self._check_tokens()
        self._check_spans()
        self._check_weights()
        self._check_sample_mask()
        self._check_sampling()

    @property
    def sampling_recorded(self) -> bool:
        """Whether the row says how its tokens were sampled (every row of schema 3 does)."""
        return self.temperature is not None

    @property
    def truncates(self) -> bool | None:
        """Whether the row's sampling drew from kept subsets (top-p / top-k); None when not recorded."""
        if not self.sampling_recorded:
            return None
        return truncates(self.temperature, self.top_p, self.top_k)  # type: ignore[arg-type]

    @property
    def kept(self) -> KeptSets:
        """The row's sampling mask: one kept set per sampled token, in order (empty without one)."""
        return KeptSets(self.kept_counts, self.kept_token_ids)

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
        try:
            for name, minimum in (("prompt_len", 0), ("group_size", 1), ("num_turns", 0), ("sample_mask", 0)):
                check_int(getattr(self, name), field=name, minimum=minimum)
            if self.reward is not None:
                check_finite(self.reward, field="reward")
            check_finite(self.advantage, field="advantage")
            check_choice(self.terminal_selection, (*TERMINAL_SELECTIONS, None), field="terminal_selection")
            if self.mask_reason is not None:
                check_reason(self.mask_reason, field="mask_reason")
        except (TypeError, ValueError) as exc:
            raise self._fail(str(exc)) from None
        if not isinstance(self.truncated, bool):
            raise self._fail(f"truncated must be a bool, got {self.truncated!r}")

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

    def _check_weights(self) -> None:
        weights = self.weights_by_version
        if not all(isinstance(w, VersionWeights) for w in weights):
            raise self._fail("weights_by_version must hold VersionWeights items")
        if bool(weights) != bool(self.input_ids.size):
            raise self._fail("weights_by_version is empty exactly when the row has no tokens")
        versions = [w.weight_version for w in weights]
        try:
            for version in versions:
                check_int(version, field="weights_by_version weight_version", minimum=0)
        except (TypeError, ValueError) as exc:
            raise self._fail(str(exc)) from None
        if versions != sorted(set(versions)):
            raise self._fail(f"weights_by_version must name each version once, ascending, got {versions}")
        named = [w.weights_sha256 for w in weights if w.weights_sha256 is not None]
        bad = [sha for sha in named if not is_hex_digest(sha)]
        if bad:
            raise self._fail(f"weights_by_version names {str(bad[0])[:80]!r}, not a sha256 (64 lowercase hex digits)")
        unnamed = sorted({s.weight_version for s in self.weight_version_spans} - set(versions))
        if unnamed:
            raise self._fail(f"weights_by_version does not name weight version(s) {unnamed} of weight_version_spans")

    def _check_sample_mask(self) -> None:
        if self.sample_mask == 1:
            if self.mask_reason is not None:
                raise self._fail(f"a trainable row (sample_mask 1) has mask_reason {self.mask_reason!r}")
            if self.reward is None or self.terminal_selection is None or not self.loss_mask.any():
                raise self._fail("a trainable row needs a reward, a terminal selection and a sampled token")
        elif self.sample_mask == 0:
            if self.mask_reason is None:
                raise self._fail("a masked row (sample_mask 0) needs a mask_reason")
            if self.advantage != 0:
                raise self._fail(f"a masked row has advantage {self.advantage}, expected 0")
        else:
            raise self._fail(f"sample_mask must be 0 or 1, got {self.sample_mask!r}")

    def _check_sampling(self) -> None:
        recorded = [getattr(self, name) is not None for name in SAMPLING_COLUMNS]
        if any(recorded) and not all(recorded):
            raise self._fail(f"the sampling columns {list(SAMPLING_COLUMNS)} are all null (not recorded) or all set")
        sampled = self.input_ids[self.loss_mask == 1]
        kept = self.kept
        if all(recorded):
            try:
                settings = SamplingSettings(
                    temperature=self.temperature,  # type: ignore[arg-type]
                    top_p=self.top_p,  # type: ignore[arg-type]
                    top_k=self.top_k,  # type: ignore[arg-type]
                    logprobs_mode=self.logprobs_mode,  # type: ignore[arg-type]
                )
            except (TypeError, ValueError) as exc:
                raise self._fail(f"sampling: {exc}") from None
            expected = settings.truncates and sampled.size > 0
        else:
            expected = False
        if bool(kept) != expected:
            raise self._fail(
                "kept sets are present exactly when the row's sampling is recorded and truncates and it has a sampled "
                f"token (recorded: {all(recorded)}, truncates: {bool(all(recorded) and self.truncates)}, sampled "
                f"tokens: {sampled.size}), but it {'has none' if expected else f'has {kept.counts.size}'}"
            )
        if not kept and self.kept_token_ids.size:
            raise self._fail("kept_token_ids holds ids without kept_counts")
        if kept:
            try:
                kept.check(sampled)
            except ValueError as exc:
                raise self._fail(f"kept sets: {exc}") from None


def upgrade_rows(table: pa.Table) -> pa.Table:
    """``table`` of dataset rows in the current schema (version 3): older versions gain the columns they lack.

    Version 1 (:data:`V1_SCHEMA`) rows never named their weights, so each version of a row's
    ``weight_version_spans`` is named with a null sha256: declared, not verified. Version 1 and 2
    (:data:`V2_SCHEMA`) rows never recorded their sampling: the sampling columns read null (not
    recorded) and the kept sets empty (no mask is claimed). A table of any other schema is
    returned as it is (:meth:`DatasetRow.check_table` then names what is wrong).
    """
    if table.schema.equals(V1_SCHEMA):
        table = _weights_declared(table)
    if not table.schema.equals(V2_SCHEMA):
        return table
    for name in (*SAMPLING_COLUMNS, *KEPT_COLUMNS):
        field = DatasetRow.arrow_schema().field(name)
        if name in KEPT_COLUMNS:  # an empty list per row
            values = pa.ListArray.from_arrays(
                pa.array(np.zeros(table.num_rows + 1, np.int32)), pa.array([], pa.int32())
            )
        else:
            values = pa.nulls(table.num_rows, field.type)
        table = table.append_column(field, values)
    return table


def _weights_declared(table: pa.Table) -> pa.Table:
    """A version-1 table as version 2: each row's weight versions named with a null sha256."""
    spans = table.column("weight_version_spans").combine_chunks()
    lengths = pc.list_value_length(spans).to_numpy(zero_copy_only=False)
    row = np.repeat(np.arange(table.num_rows, dtype=np.int64), lengths)
    version = pc.struct_field(pc.list_flatten(spans), "weight_version").to_numpy(zero_copy_only=False)
    order = np.lexsort((version, row))
    row, version = row[order], version[order]
    kept = np.ones(row.size, bool)
    kept[1:] = (row[1:] != row[:-1]) | (version[1:] != version[:-1])
    starts = np.zeros(table.num_rows + 1, np.int32)
    np.cumsum(np.bincount(row[kept], minlength=table.num_rows), out=starts[1:])
    items = pa.StructArray.from_arrays(
        [pa.array(version[kept], pa.uint64()), pa.nulls(int(kept.sum()), pa.string())],
        fields=list(VERSION_WEIGHTS_TYPE),
    )
    weights = pa.ListArray.from_arrays(pa.array(starts), items, type=pa.list_(VERSION_WEIGHTS_TYPE))
    where = V2_SCHEMA.get_field_index("weights_by_version")
    return table.add_column(where, V2_SCHEMA.field(where), weights)


def _without(schema: pa.Schema, names: tuple[str, ...]) -> pa.Schema:
    for name in names:
        schema = schema.remove(schema.get_field_index(name))
    return schema


# The schemas of older parts (pinned by tests/compat): version 2 is today's without the sampling columns
# and kept sets, version 1 version 2's without weights_by_version.
V2_SCHEMA = _without(DatasetRow.arrow_schema(), (*SAMPLING_COLUMNS, *KEPT_COLUMNS))
V1_SCHEMA = _without(V2_SCHEMA, ("weights_by_version",))
