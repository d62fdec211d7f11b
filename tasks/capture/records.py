"""Capture records (ARCHITECTURE 4.1, 4.3-4.5), each defined once with its Arrow schema.

Constructing a record enforces the invariants of its section; a record that exists is
well-formed. Hashes that need the parent chain (chain and cumulative hashes) can only be
checked by a verifier that walks the chain; everything else is checked here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.capture import digest as dg
from tasks.ids import ID_PATTERN, MAX_ID_LENGTH, check_id, check_optional_id
from tasks.schema import ArrowRecord, Column, column, frozen_array, fullmatch, null_or

REASON_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
RECEIPT_STATUSES = ("ok", "poisoned", "failed")
TERMINAL_SELECTIONS = ("declared", "response_id", "content", "heuristic")
LOGPROBS_MODES = ("processed",)
_I64_MAX = 2**63 - 1


def canonical_json(value: Any) -> str:
    """Canonical JSON (sorted keys, no spaces, no NaN): the stored form of extras and reward info."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def check_reason(value: object, *, field: str) -> str:
    if not isinstance(value, str) or not REASON_PATTERN.fullmatch(value):
        raise ValueError(f"{field} must be a snake_case reason name, got {value!r}")
    return value


def _check_finite(value: object, *, field: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number, got {value!r}")


def _check_int(value: object, *, field: str, minimum: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{field} must be an int >= {minimum}, got {value!r}")


_NULL_EXTRAS = ("null", dg.compute_extras_digest(None))


# Big-endian float32 0.0 and 1.0: the wire form of carried and sampled mask entries.
_WIRE_ZERO = b"\x00\x00\x00\x00"
_WIRE_ONE = b"\x3f\x80\x00\x00"


def _read_only(fresh: np.ndarray) -> np.ndarray:
    """Freeze an array this module just allocated (no copy: nobody else holds it)."""
    fresh.flags.writeable = False
    return fresh


def _id_array(values: Any, *, field: str) -> np.ndarray:
    """Token ids as a flat uint64 array, values unchecked (see :func:`_check_id_range`)."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        if values.dtype.itemsize == 8:
            return values.view(np.uint64)
        return values.astype(np.int64).view(np.uint64)
    return dg.token_array(values, field=field)


def _check_id_range(ids: np.ndarray, *, field: str) -> None:
    """Every id of a uint64 view is a valid int64 token id (negatives wrapped past int64)."""
    if ids.size and int(ids.max()) > _I64_MAX:
        raise ValueError(f"{field} holds a token id outside [0, 2**63) (a negative id, or one past int64)")


def _extras_fields(extras: Any) -> tuple[str, str]:
    """(canonical JSON, extras digest) of a call's extras; ``None`` is the common, precomputed case."""
    if extras is None:
        return _NULL_EXTRAS
    return canonical_json(extras), dg.compute_extras_digest(extras)


def _check_call_settings(delta: StagedDelta) -> None:
    """Identity and sampling fields of a staged delta: the checks ``build`` cannot derive."""
    check_id(delta.batch_id, field="batch_id")
    check_id(delta.rollout_id, field="rollout_id")
    check_id(delta.call_id, field="call_id")
    check_optional_id(delta.parent_call_id, field="parent_call_id")
    dg.check_u64(delta.weight_version, field="weight_version")
    if not isinstance(delta.finish_reason, str) or not delta.finish_reason:
        raise ValueError(f"finish_reason must be a non-empty str, got {delta.finish_reason!r}")
    _check_finite(delta.temperature, field="temperature")
    _check_finite(delta.top_p, field="top_p")
    if not isinstance(delta.top_k, int) or isinstance(delta.top_k, bool) or delta.top_k < -1:
        raise ValueError(f"top_k must be an int >= -1 (-1 disables it), got {delta.top_k!r}")
    if delta.logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {delta.logprobs_mode!r}")


@dataclass(frozen=True, eq=False)
class StagedDelta(ArrowRecord):
    """The token-bearing delta of one model call: the only place tokens live before finalization.

    delta = prompt_ids[prev_len:] + generated_ids; mask 0.0 for carried prompt tokens, 1.0 for
    sampled ones; logprobs exactly 0.0 where the mask is 0.0, finite float32 elsewhere.
    """

    schema_version: int = column(pa.int32())
    digest_version: int = column(pa.int32())
    extras_digest_version: int = column(pa.int32())
    batch_id: str = column(pa.string())
    rollout_id: str = column(pa.string())
    call_id: str = column(pa.string())
    parent_call_id: str | None = column(pa.string(), nullable=True)
    mode: str = column(pa.string())
    prev_len: int = column(pa.int64())
    delta_len: int = column(pa.int64())
    cum_len: int = column(pa.int64())
    weight_version: int = column(pa.uint64())
    token_ids_delta: np.ndarray = column(pa.list_(pa.int64()))
    token_mask_delta: np.ndarray = column(pa.list_(pa.float32()))
    logprobs_delta: np.ndarray = column(pa.list_(pa.float32()))
    extras_json: str = column(pa.string())
    extras_digest: str = column(pa.string())
    chain_hash: str = column(pa.string())
    cumulative_hash: str = column(pa.string())
    digest: str = column(pa.string())
    finish_reason: str = column(pa.string())
    temperature: float = column(pa.float64())
    top_p: float = column(pa.float64())
    top_k: int = column(pa.int32())
    logprobs_mode: str = column(pa.string())

    def __post_init__(self) -> None:
        for name, expected in (
            ("schema_version", dg.SCHEMA_VERSION),
            ("digest_version", dg.DIGEST_VERSION),
            ("extras_digest_version", dg.EXTRAS_DIGEST_VERSION),
        ):
            if getattr(self, name) != expected:
                raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")
        _check_call_settings(self)
        ids = dg.token_array(self.token_ids_delta, field="token_ids_delta")
        if ids.size and int(ids.max()) > _I64_MAX:
            raise ValueError("token_ids_delta holds an id past int64")
        mask = dg.float32_array(self.token_mask_delta, field="token_mask_delta")
        logprobs = dg.float32_array(self.logprobs_delta, field="logprobs_delta")
        for name in ("prev_len", "delta_len", "cum_len"):
            _check_int(getattr(self, name), field=name)
        dg.check_call_shape(
            parent_call_id=self.parent_call_id,
            mode=self.mode,
            prev_len=self.prev_len,
            delta_len=self.delta_len,
            cum_len=self.cum_len,
            list_lengths={"token_ids_delta": ids.size, "token_mask_delta": mask.size, "logprobs_delta": logprobs.size},
        )
        dg.check_mask_and_logprobs(mask, logprobs)
        for name in ("extras_digest", "chain_hash", "cumulative_hash", "digest"):
            dg.check_hex_digest(getattr(self, name), field=name)
        try:
            extras = json.loads(self.extras_json)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"extras_json is not valid JSON: {exc}") from None
        if canonical_json(extras) != self.extras_json:
            raise ValueError("extras_json is not in canonical form (sorted keys, no spaces)")
        if dg.compute_extras_digest(extras) != self.extras_digest:
            raise ValueError("extras_digest does not match extras_json")
        object.__setattr__(self, "token_ids_delta", frozen_array(ids, np.int64))
        object.__setattr__(self, "token_mask_delta", frozen_array(mask, np.float32))
        object.__setattr__(self, "logprobs_delta", frozen_array(logprobs, np.float32))

    @classmethod
    def build(
        cls,
        *,
        batch_id: str,
        rollout_id: str,
        call_id: str,
        parent_call_id: str | None,
        parent_chain_hash: str | None,
        prefix_token_ids: np.ndarray | list[int],
        prompt_token_ids: np.ndarray | list[int],
        generated_token_ids: np.ndarray | list[int],
        generated_logprobs: np.ndarray | list[float],
        weight_version: int,
        finish_reason: str,
        temperature: float,
        top_p: float,
        top_k: int,
        extras: Any = None,
        logprobs_mode: str = "processed",
    ) -> Self:
        """Build the delta of one call and compute all of its hashes.

        ``prefix_token_ids`` are the parent's exact tokens (empty for a root); the prompt must
        start with them. The delta is the prompt past the prefix followed by the generation.
        This is the hot path of staging: every input is checked once, the arrays and hashes
        are derived from checked values, so the result satisfies ``__post_init__``'s
        invariants by construction and is not re-validated.
        """
        prefix = _id_array(prefix_token_ids, field="prefix_token_ids")
        prompt = _id_array(prompt_token_ids, field="prompt_token_ids")
        generated = _id_array(generated_token_ids, field="generated_token_ids")
        sampled = dg.float32_array(generated_logprobs, field="generated_logprobs")
        prev_len = prefix.size
        if sampled.size != generated.size:
            raise ValueError(f"generated_logprobs has {sampled.size} entries for {generated.size} generated tokens")
        # Bytes equality: the same test as np.array_equal on equal dtypes, at half the cost.
        if prompt.size < prev_len or prompt[:prev_len].tobytes() != prefix.tobytes():
            raise ValueError(f"prompt of {call_id} does not start with its parent's {prev_len} exact tokens")
        if (parent_call_id is None) != (prev_len == 0) or (parent_call_id is None) != (parent_chain_hash is None):
            raise ValueError(
                f"call {call_id}: a root has no parent, no parent chain hash and no prefix; "
                f"a child has all three (parent {parent_call_id!r}, prefix of {prev_len} tokens)"
            )
        if parent_chain_hash is not None:
            dg.check_hex_digest(parent_chain_hash, field="parent_chain_hash")
        # The prompt starts with the prefix, so these two checks cover every id of the sequence.
        _check_id_range(prompt, field="prompt_token_ids")
        _check_id_range(generated, field="generated_token_ids")
        carry = prompt.size - prev_len
        delta_len = carry + generated.size
        if delta_len == 0:
            raise ValueError(f"call {call_id} has an empty delta: no new prompt tokens and no generation")
        cum_len = prev_len + delta_len
        weight_version = dg.check_u64(weight_version, field="weight_version")
        extras_json, extras_digest = _extras_fields(extras)
        # Each list is converted to its wire byte order once; every hash reads those buffers.
        wire_prompt = prompt.astype(">u8")
        wire_generated = generated.astype(">u8")
        wire_ids = wire_prompt[prev_len:].tobytes() + wire_generated.tobytes()
        chain = dg.chain_hash_of_encoded(parent_chain_hash, delta_len, wire_ids)
        cumulative = dg.cumulative_hash_of_encoded(cum_len, wire_prompt, wire_generated)
        mode = "text" if parent_call_id is None else "token_in"
        digest = dg.digest_of_encoded_call(
            rollout_id=rollout_id,
            call_id=call_id,
            parent_call_id=parent_call_id,
            mode=mode,
            lengths=(prev_len, delta_len, cum_len, weight_version),
            count=delta_len,
            ids=wire_ids,
            mask=_WIRE_ZERO * carry + _WIRE_ONE * generated.size,
            logprobs=_WIRE_ZERO * carry + sampled.astype(">f4").tobytes(),
            extras_digest=extras_digest,
            chain_hash=chain,
            cumulative_hash=cumulative,
        )
        ids = np.frombuffer(wire_ids, dtype=">i8").astype(np.int64)
        mask = np.zeros(delta_len, np.float32)
        mask[carry:] = 1.0
        logprobs = np.zeros(delta_len, np.float32)
        logprobs[carry:] = sampled
        fields = {
            "schema_version": dg.SCHEMA_VERSION,
            "digest_version": dg.DIGEST_VERSION,
            "extras_digest_version": dg.EXTRAS_DIGEST_VERSION,
            "batch_id": batch_id,
            "rollout_id": rollout_id,
            "call_id": call_id,
            "parent_call_id": parent_call_id,
            "mode": mode,
            "prev_len": prev_len,
            "delta_len": delta_len,
            "cum_len": cum_len,
            "weight_version": weight_version,
            "token_ids_delta": _read_only(ids),
            "token_mask_delta": _read_only(mask),
            "logprobs_delta": _read_only(logprobs),
            "extras_json": extras_json,
            "extras_digest": extras_digest,
            "chain_hash": chain,
            "cumulative_hash": cumulative,
            "digest": digest,
            "finish_reason": finish_reason,
            "temperature": float(temperature),
            "top_p": float(top_p),
            "top_k": top_k,
            "logprobs_mode": logprobs_mode,
        }
        delta = cls.trusted(fields)
        _check_call_settings(delta)
        return delta

    @property
    def staging_key(self) -> str:
        return f"{self.rollout_id}/{self.call_id}"

    def recompute_digest(self) -> str:
        """The call digest of this row's fields as stored (the chain fields are taken as given)."""
        return dg.compute_staging_digest(
            rollout_id=self.rollout_id,
            call_id=self.call_id,
            parent_call_id=self.parent_call_id,
            mode=self.mode,
            prev_len=self.prev_len,
            delta_len=self.delta_len,
            cum_len=self.cum_len,
            weight_version=self.weight_version,
            token_ids_delta=self.token_ids_delta,
            token_mask_delta=self.token_mask_delta,
            logprobs_delta=self.logprobs_delta,
            extras_digest=self.extras_digest,
            chain_hash=self.chain_hash,
            cumulative_hash=self.cumulative_hash,
        )


@dataclass(frozen=True, eq=False)
class CallRecord(ArrowRecord):
    """Token-free ledger row of one call, written only after its staged segment is durable.

    ``staging_segment`` is the segment object's path relative to the batch directory and
    ``staging_row`` its row there; together they are the commit coordinates.
    """

    batch_id: str = column(pa.string())
    rollout_id: str = column(pa.string())
    call_id: str = column(pa.string())
    parent_call_id: str | None = column(pa.string(), nullable=True)
    mode: str = column(pa.string())
    prev_len: int = column(pa.int64())
    delta_len: int = column(pa.int64())
    cum_len: int = column(pa.int64())
    weight_version: int = column(pa.uint64())
    epoch_span: bool = column(pa.bool_())
    digest: str = column(pa.string())
    extras_digest: str = column(pa.string())
    chain_hash: str = column(pa.string())
    cumulative_hash: str = column(pa.string())
    staging_segment: str = column(pa.string())
    staging_row: int = column(pa.int64())
    admitted_at: float | None = column(pa.float64(), nullable=True)
    finish_reason: str = column(pa.string())
    output_fingerprint: str | None = column(pa.string(), nullable=True)
    response_id: str | None = column(pa.string(), nullable=True)

    def __post_init__(self) -> None:
        check_id(self.batch_id, field="batch_id")
        check_id(self.rollout_id, field="rollout_id")
        check_id(self.call_id, field="call_id")
        check_optional_id(self.parent_call_id, field="parent_call_id")
        for name in ("prev_len", "delta_len", "cum_len", "staging_row"):
            _check_int(getattr(self, name), field=name)
        dg.check_u64(self.weight_version, field="weight_version")
        dg.check_call_shape(
            parent_call_id=self.parent_call_id,
            mode=self.mode,
            prev_len=self.prev_len,
            delta_len=self.delta_len,
            cum_len=self.cum_len,
            list_lengths={},
        )
        if not isinstance(self.epoch_span, bool):
            raise TypeError(f"epoch_span must be a bool, got {self.epoch_span!r}")
        for name in ("digest", "extras_digest", "chain_hash", "cumulative_hash"):
            dg.check_hex_digest(getattr(self, name), field=name)
        if self.output_fingerprint is not None:
            dg.check_hex_digest(self.output_fingerprint, field="output_fingerprint")
        if not isinstance(self.staging_segment, str) or not self.staging_segment.startswith("staging/"):
            raise ValueError(f"staging_segment must be a batch-relative staging/ path, got {self.staging_segment!r}")
        _check_finite(self.admitted_at, field="admitted_at", allow_none=True)
        if not isinstance(self.finish_reason, str) or not self.finish_reason:
            raise ValueError(f"finish_reason must be a non-empty str, got {self.finish_reason!r}")
        if self.response_id is not None and (not isinstance(self.response_id, str) or not self.response_id):
            raise ValueError(f"response_id must be a non-empty str or None, got {self.response_id!r}")

    @classmethod
    def column_rules(cls, t: pa.Table) -> list[Column]:
        """The column-wise form of ``__post_init__``: one boolean column per invariant (see ``schema.all_hold``)."""
        root = pc.equal(t["mode"], "text")
        return [
            *_ids(t, "batch_id", "rollout_id", "call_id"),
            *_ids(t, "parent_call_id", optional=True),
            *(pc.greater_equal(t[name], 0) for name in ("prev_len", "delta_len", "cum_len", "staging_row")),
            # dg.check_call_shape
            pc.is_in(t["mode"], value_set=pa.array(dg.MODES)),
            pc.equal(pc.is_null(t["parent_call_id"]), root),
            pc.equal(pc.equal(t["prev_len"], 0), root),
            pc.greater_equal(t["delta_len"], 1),
            pc.equal(t["cum_len"], pc.add_checked(t["prev_len"], t["delta_len"])),
            *_hex(t, "digest", "extras_digest", "chain_hash", "cumulative_hash"),
            *_hex(t, "output_fingerprint", optional=True),
            pc.starts_with(t["staging_segment"], "staging/"),
            null_or(t["admitted_at"], pc.is_finite(t["admitted_at"])),
            pc.greater(pc.utf8_length(t["finish_reason"]), 0),
            null_or(t["response_id"], pc.greater(pc.utf8_length(t["response_id"]), 0)),
        ]

    @property
    def staging_key(self) -> str:
        return f"{self.rollout_id}/{self.call_id}"

    @classmethod
    def for_staged(
        cls,
        delta: StagedDelta,
        *,
        staging_segment: str,
        staging_row: int,
        admitted_at: float | None,
        epoch_span: bool = False,
        output_fingerprint: str | None = None,
        response_id: str | None = None,
    ) -> Self:
        """The ledger record of a staged delta at its commit coordinates."""
        return cls(
            batch_id=delta.batch_id,
            rollout_id=delta.rollout_id,
            call_id=delta.call_id,
            parent_call_id=delta.parent_call_id,
            mode=delta.mode,
            prev_len=delta.prev_len,
            delta_len=delta.delta_len,
            cum_len=delta.cum_len,
            weight_version=delta.weight_version,
            epoch_span=epoch_span,
            digest=delta.digest,
            extras_digest=delta.extras_digest,
            chain_hash=delta.chain_hash,
            cumulative_hash=delta.cumulative_hash,
            staging_segment=staging_segment,
            staging_row=staging_row,
            admitted_at=admitted_at,
            finish_reason=delta.finish_reason,
            output_fingerprint=output_fingerprint,
            response_id=response_id,
        )


@dataclass(frozen=True, eq=False)
class FailureRow(ArrowRecord):
    """A call that could not be captured; never resolvable as a parent, poisons its rollout."""

    batch_id: str = column(pa.string())
    rollout_id: str = column(pa.string())
    call_id: str = column(pa.string())
    parent_call_id: str | None = column(pa.string(), nullable=True)
    reason: str = column(pa.string())
    detail: str = column(pa.string())

    def __post_init__(self) -> None:
        check_id(self.batch_id, field="batch_id")
        check_id(self.rollout_id, field="rollout_id")
        check_id(self.call_id, field="call_id")
        check_optional_id(self.parent_call_id, field="parent_call_id")
        check_reason(self.reason, field="reason")
        if not isinstance(self.detail, str):
            raise TypeError(f"detail must be a str, got {type(self.detail).__name__}")

    @classmethod
    def column_rules(cls, t: pa.Table) -> list[Column]:
        """The column-wise form of ``__post_init__``: one boolean column per invariant (see ``schema.all_hold``)."""
        return [
            *_ids(t, "batch_id", "rollout_id", "call_id"),
            *_ids(t, "parent_call_id", optional=True),
            _reason(t["reason"]),
        ]


@dataclass(frozen=True, eq=False)
class Receipt(ArrowRecord):
    """The final word on one rollout: its reward, terminal call and status.

    ok => terminal call and selection method set, no failure reason, a finite reward;
    poisoned / failed => a failure reason; terminal call and selection are set together.
    """

    rollout_id: str = column(pa.string())
    group_id: str = column(pa.string())
    attempt: int = column(pa.int32())
    reward: float | None = column(pa.float64(), nullable=True)
    reward_info: str = column(pa.string())
    terminal_call_id: str | None = column(pa.string(), nullable=True)
    terminal_selection: str | None = column(pa.string(), nullable=True)
    terminal_attribution_reason: str | None = column(pa.string(), nullable=True)
    status: str = column(pa.string())
    failure_reason: str | None = column(pa.string(), nullable=True)
    num_calls: int = column(pa.int64())

    def __post_init__(self) -> None:
        check_id(self.rollout_id, field="rollout_id")
        check_id(self.group_id, field="group_id")
        check_optional_id(self.terminal_call_id, field="terminal_call_id")
        _check_int(self.attempt, field="attempt")
        _check_int(self.num_calls, field="num_calls")
        _check_finite(self.reward, field="reward", allow_none=True)
        try:
            info = json.loads(self.reward_info)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"reward_info is not valid JSON: {exc}") from None
        if canonical_json(info) != self.reward_info:
            raise ValueError("reward_info is not in canonical JSON form")
        if self.status not in RECEIPT_STATUSES:
            raise ValueError(f"status must be one of {RECEIPT_STATUSES}, got {self.status!r}")
        if self.terminal_selection is not None and self.terminal_selection not in TERMINAL_SELECTIONS:
            raise ValueError(
                f"terminal_selection must be one of {TERMINAL_SELECTIONS}, got {self.terminal_selection!r}"
            )
        if (self.terminal_call_id is None) != (self.terminal_selection is None):
            raise ValueError("terminal_call_id and terminal_selection must be set together")
        if self.terminal_attribution_reason is not None:
            check_reason(self.terminal_attribution_reason, field="terminal_attribution_reason")
        if self.status == "ok":
            if self.terminal_call_id is None:
                raise ValueError(f"receipt of {self.rollout_id} is ok but names no terminal call")
            if self.failure_reason is not None:
                raise ValueError(f"receipt of {self.rollout_id} is ok but has failure_reason {self.failure_reason!r}")
            if self.reward is None:
                raise ValueError(f"receipt of {self.rollout_id} is ok but has no reward")
            if self.num_calls < 1:
                raise ValueError(f"receipt of {self.rollout_id} is ok but has no calls")
        else:
            if self.failure_reason is None:
                raise ValueError(f"receipt of {self.rollout_id} is {self.status} but names no failure_reason")
            check_reason(self.failure_reason, field="failure_reason")

    @classmethod
    def column_rules(cls, t: pa.Table) -> list[Column]:
        """The column-wise form of ``__post_init__``: one boolean column per invariant (see ``schema.all_hold``)."""
        ok = pc.equal(t["status"], "ok")
        ok_holds = pc.and_(
            pc.and_(pc.is_valid(t["terminal_call_id"]), pc.is_null(t["failure_reason"])),
            pc.and_(pc.is_valid(t["reward"]), pc.greater_equal(t["num_calls"], 1)),
        )
        return [
            *_ids(t, "rollout_id", "group_id"),
            *_ids(t, "terminal_call_id", optional=True),
            pc.greater_equal(t["attempt"], 0),
            pc.greater_equal(t["num_calls"], 0),
            null_or(t["reward"], pc.is_finite(t["reward"])),
            pa.array([_is_canonical_json(text) for text in pc.unique(t["reward_info"]).to_pylist()], pa.bool_()),
            pc.is_in(t["status"], value_set=pa.array(RECEIPT_STATUSES)),
            null_or(
                t["terminal_selection"], pc.is_in(t["terminal_selection"], value_set=pa.array(TERMINAL_SELECTIONS))
            ),
            pc.equal(pc.is_null(t["terminal_call_id"]), pc.is_null(t["terminal_selection"])),
            null_or(t["terminal_attribution_reason"], _reason(t["terminal_attribution_reason"])),
            pc.if_else(ok, ok_holds, pc.fill_null(_reason(t["failure_reason"]), False)),
        ]


# --- column-wise invariants (the ledger reader checks whole tables with these) ---


def _ids(table: pa.Table, *names: str, optional: bool = False) -> list[Column]:
    """``check_id`` (``check_optional_id`` when ``optional``) of each named column."""
    rules = []
    for name in names:
        column = table.column(name)
        holds = pc.and_(fullmatch(column, ID_PATTERN), pc.less_equal(pc.utf8_length(column), MAX_ID_LENGTH))
        rules.append(null_or(column, holds) if optional else holds)
    return rules


def _hex(table: pa.Table, *names: str, optional: bool = False) -> list[Column]:
    """``check_hex_digest`` of each named column (null allowed when ``optional``)."""
    rules = [fullmatch(table.column(name), dg.HEX_DIGEST) for name in names]
    return [null_or(table.column(n), r) for n, r in zip(names, rules, strict=True)] if optional else rules


def _reason(column: Column) -> Column:
    return fullmatch(column, REASON_PATTERN)


def _is_canonical_json(text: str) -> bool:
    try:
        return canonical_json(json.loads(text)) == text
    except (ValueError, TypeError):
        return False
