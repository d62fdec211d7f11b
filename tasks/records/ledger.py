"""Capture records (docs/architecture.md §4.1, §4.3-4.5), each defined once with its Arrow schema and rules.

Each record declares the invariants of its section once, as rules (:mod:`tasks.records.rules`):
constructing a record checks them on its values, and the ledger reader proves them on whole
tables with the same rules. A record that exists is well-formed. Hashes that need the parent
chain (chain and cumulative hashes) can only be checked by a verifier that walks the chain;
everything else is checked here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np
import pyarrow as pa

from tasks.checks import REASON_NAME, check_hex_digest, check_u64
from tasks.records import digest as dg
from tasks.records.rules import (
    Ops,
    RecordRules,
    Rule,
    at_least,
    equal_to,
    finite,
    hex_digests,
    id_lists,
    ids,
    non_empty,
    one_of,
    reasons,
)
from tasks.records.sampling_mask import KEPT_DIGEST_KEY, KEPT_NOTE, KeptSets
from tasks.schema import ArrowRecord, column, frozen_array

RECEIPT_STATUSES = ("ok", "poisoned", "failed")
TERMINAL_SELECTIONS = ("declared", "response_id", "content", "heuristic")
LOGPROBS_MODES = ("processed",)
_I64_MAX = 2**63 - 1


def canonical_json(value: Any) -> str:
    """Canonical JSON (sorted keys, no spaces, no NaN): the stored form of extras and reward info."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def is_canonical_json(text: str) -> bool:
    """Whether ``text`` is JSON in its canonical form (:func:`canonical_json` of what it parses to)."""
    try:
        return canonical_json(json.loads(text)) == text
    except (ValueError, TypeError):
        return False


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


def _check_kept(kept: KeptSets, sampled: np.ndarray, extras: Any, call_id: str) -> None:
    """A call's kept sets fit its sampled tokens (:meth:`KeptSets.check`), and its extras name their digest exactly
    when it has them (the call digest covers its extras, so its chain covers its mask)."""
    try:
        kept.check(sampled) if kept else None
    except ValueError as exc:
        raise ValueError(f"call {call_id}: {exc}") from None
    note = extras.get(KEPT_NOTE) if isinstance(extras, dict) else None
    named = note.get(KEPT_DIGEST_KEY) if isinstance(note, dict) else None
    if kept and named != kept.digest():
        raise ValueError(f"call {call_id}: its extras do not name the digest of its kept sets")
    if not kept and named is not None:
        raise ValueError(f"call {call_id}: its extras name kept sets it does not hold")


def _check_mask_and_logprobs(mask: np.ndarray, logprobs: np.ndarray) -> None:
    """Masks are exactly 0.0 / 1.0; logprobs are exactly 0.0 where the mask is 0 (a carried token)."""
    if mask.size and not ((mask == 0.0) | (mask == 1.0)).all():
        raise ValueError("token_mask_delta holds a value other than 0.0 or 1.0")
    carried = mask == 0.0
    if carried.any() and np.any(logprobs[carried] != 0.0):
        raise ValueError("logprobs_delta must be exactly 0.0 where token_mask_delta is 0.0 (carried prompt)")


def _extras_fields(extras: Any) -> tuple[str, str]:
    """(canonical JSON, extras digest) of a call's extras; ``None`` is the common, precomputed case."""
    if extras is None:
        return _NULL_EXTRAS
    return canonical_json(extras), dg.compute_extras_digest(extras)


def _canonical_json_rule(name: str) -> Rule:
    """The field holds JSON in canonical form (:func:`canonical_json`)."""
    return Rule(
        name=f"{name}_is_canonical_json",
        fields=(name,),
        predicate=lambda o, text: o.satisfies(text, is_canonical_json),
        message=f"{name} must be canonical JSON (sorted keys, no spaces), got {{{name}!r}}",
    )


def _when_ok(name: str, field: str, holds: Callable[[Ops, Any], Any], breach: str) -> Rule:
    """A receipt whose status is ok satisfies ``holds`` on ``field``; ``breach`` says how it does not."""
    return Rule(
        name=name,
        fields=("status", field),
        predicate=lambda o, status, value: o.implies(o.eq(status, "ok"), holds(o, value)),
        message=f"receipt of {{rollout_id}} is ok but {breach}",
    )


# --- rules shared by the staged delta and the call record (docs/architecture.md §4.1, §4.3) -----------------

CALL_IDENTITY = (*ids("batch_id", "rollout_id", "call_id"), *ids("parent_call_id", optional=True))
# root <=> parent null <=> prev_len 0 <=> mode text; delta_len >= 1; cum_len = prev_len + delta_len.
CALL_SHAPE = (
    *at_least(0, "prev_len", "cum_len"),
    *one_of("mode", dg.MODES),
    Rule(
        name="root_has_no_parent",
        fields=("parent_call_id", "mode"),
        predicate=lambda o, parent, mode: o.iff(o.is_null(parent), o.eq(mode, "text")),
        message="parent_call_id {parent_call_id!r} contradicts mode {mode!r}: "
        "a root (mode text) has no parent, a token_in child has one",
    ),
    Rule(
        name="root_has_no_prefix",
        fields=("prev_len", "mode"),
        predicate=lambda o, prev_len, mode: o.iff(o.eq(prev_len, 0), o.eq(mode, "text")),
        message="prev_len {prev_len} contradicts mode {mode!r}: roots have prev_len 0, children > 0",
    ),
    *at_least(1, "delta_len"),
    Rule(
        name="cum_len_is_prev_len_plus_delta_len",
        fields=("cum_len", "prev_len", "delta_len"),
        predicate=lambda o, cum_len, prev_len, delta_len: o.eq(cum_len, o.add(prev_len, delta_len)),
        message="cum_len {cum_len} != prev_len {prev_len} + delta_len {delta_len}",
    ),
)
CALL_HASHES = hex_digests("extras_digest", "chain_hash", "cumulative_hash", "digest")
# What StagedDelta.build takes from its caller as given: every other field it derives, checked.
STAGED_SETTINGS = RecordRules(
    CALL_IDENTITY,
    non_empty("finish_reason"),
    finite("temperature", "top_p"),
    at_least(-1, "top_k"),
    one_of("logprobs_mode", LOGPROBS_MODES),
)


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
    # The sampling mask (tasks.records.sampling_mask): per sampled token, the ids its sampler kept; empty when the
    # call did not truncate. Newer than the first segments written, whose rows read as empty.
    kept_counts: np.ndarray = column(pa.list_(pa.int32()), added=())
    kept_token_ids: np.ndarray = column(pa.list_(pa.int32()), added=())

    rules: ClassVar[RecordRules] = RecordRules(
        equal_to("schema_version", dg.SCHEMA_VERSION),
        equal_to("digest_version", dg.DIGEST_VERSION),
        equal_to("extras_digest_version", dg.EXTRAS_DIGEST_VERSION),
        STAGED_SETTINGS.rules,
        CALL_SHAPE,
        CALL_HASHES,
        _canonical_json_rule("extras_json"),
    )

    def __post_init__(self) -> None:
        """Check the rules, then the token lists (docs/architecture.md §4.1), and freeze them as numpy arrays."""
        self.rules.check(self)
        ids = dg.token_array(self.token_ids_delta, field="token_ids_delta")
        _check_id_range(ids, field="token_ids_delta")
        mask = dg.float32_array(self.token_mask_delta, field="token_mask_delta")
        logprobs = dg.float32_array(self.logprobs_delta, field="logprobs_delta")
        for name, values in (("token_ids_delta", ids), ("token_mask_delta", mask), ("logprobs_delta", logprobs)):
            if values.size != self.delta_len:
                raise ValueError(f"{name} has {values.size} entries but delta_len is {self.delta_len}")
        _check_mask_and_logprobs(mask, logprobs)
        extras = json.loads(self.extras_json)
        if dg.compute_extras_digest(extras) != self.extras_digest:
            raise ValueError("extras_digest does not match extras_json")
        kept = KeptSets(
            frozen_array(np.asarray(self.kept_counts, np.int32), np.int32),
            frozen_array(np.asarray(self.kept_token_ids, np.int32), np.int32),
        )
        _check_kept(kept, ids[mask == 1], extras, self.call_id)
        object.__setattr__(self, "token_ids_delta", frozen_array(ids, np.int64))
        object.__setattr__(self, "token_mask_delta", frozen_array(mask, np.float32))
        object.__setattr__(self, "logprobs_delta", frozen_array(logprobs, np.float32))
        object.__setattr__(self, "kept_counts", kept.counts)
        object.__setattr__(self, "kept_token_ids", kept.token_ids)

    @property
    def kept(self) -> KeptSets:
        """The call's sampling mask (empty when it did not truncate)."""
        return KeptSets(self.kept_counts, self.kept_token_ids)

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
        kept: KeptSets | None = None,
    ) -> Self:
        """Build the delta of one call and compute all of its hashes.

        ``prefix_token_ids`` are the parent's exact tokens (empty for a root); the prompt must
        start with them. The delta is the prompt past the prefix followed by the generation.
        This is the hot path of staging: every input is checked once, the arrays and hashes
        are derived from checked values, so the result satisfies the record's rules by
        construction; only the fields taken as given are checked (:data:`STAGED_SETTINGS`).
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
            check_hex_digest(parent_chain_hash, field="parent_chain_hash")
        # The prompt starts with the prefix, so these two checks cover every id of the sequence.
        _check_id_range(prompt, field="prompt_token_ids")
        _check_id_range(generated, field="generated_token_ids")
        carry = prompt.size - prev_len
        delta_len = carry + generated.size
        if delta_len == 0:
            raise ValueError(f"call {call_id} has an empty delta: no new prompt tokens and no generation")
        cum_len = prev_len + delta_len
        weight_version = check_u64(weight_version, field="weight_version")
        kept = kept or KeptSets.empty()
        _check_kept(kept, generated, extras, call_id)
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
            "kept_counts": _read_only(kept.counts.astype(np.int32)),
            "kept_token_ids": _read_only(kept.token_ids.astype(np.int32)),
        }
        delta = cls.trusted(fields)
        STAGED_SETTINGS.check(delta)
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

    rules: ClassVar[RecordRules] = RecordRules(
        CALL_IDENTITY,
        CALL_SHAPE,
        CALL_HASHES,
        hex_digests("output_fingerprint", optional=True),
        Rule(
            name="staging_segment_is_staged",
            fields=("staging_segment",),
            predicate=lambda o, path: o.starts_with(path, "staging/"),
            message="staging_segment must be a batch-relative staging/ path, got {staging_segment!r}",
        ),
        at_least(0, "staging_row"),
        finite("admitted_at", optional=True),
        non_empty("finish_reason"),
        non_empty("response_id", optional=True),
    )

    def __post_init__(self) -> None:
        self.rules.check(self)

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

    rules: ClassVar[RecordRules] = RecordRules(CALL_IDENTITY, reasons("reason"))

    def __post_init__(self) -> None:
        self.rules.check(self)


# Keys of a receipt's reward info that the capture adds (tasks.generate.receipts.capture_notes):
# the answers per server of an engine of several, each restart after the rollout's server was lost,
# and what resuming it did (calls replayed and sampled live after, divergences, replays refused).
SERVED_BY_NOTE, FAILED_OVER_NOTE, RESUMED_NOTE = "served_by", "failed_over", "resumed"
# The counts a ``resumed`` note holds, in order, and its list of episodes that could not replay (why).
RESUMED_COUNTS, COULD_NOT_REPLAY = ("episode", "replayed", "live", "diverged"), "could_not_replay"


@dataclass(frozen=True, eq=False)
class Receipt(ArrowRecord):
    """The final word on one rollout: its reward, terminal call and status.

    ok => terminal call and selection method set, no failure reason, a finite reward;
    poisoned / failed => a failure reason; terminal call and selection are set together.
    Its manifest is ``replayed_calls`` (call records of earlier attempts) and then its rollout's
    call records in its own attempt; ``num_calls`` counts both.
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
    # Calls of earlier attempts the rollout replayed and went on from (docs/reliability.md, resume), in replay order.
    replayed_calls: tuple[str, ...] = column(pa.list_(pa.string()), default=(), added=())

    rules: ClassVar[RecordRules] = RecordRules(
        ids("rollout_id", "group_id"),
        id_lists("replayed_calls"),
        ids("terminal_call_id", optional=True),
        at_least(0, "attempt", "num_calls"),
        finite("reward", optional=True),
        _canonical_json_rule("reward_info"),
        one_of("status", RECEIPT_STATUSES),
        one_of("terminal_selection", TERMINAL_SELECTIONS, optional=True),
        Rule(
            name="terminal_call_and_selection_together",
            fields=("terminal_call_id", "terminal_selection"),
            predicate=lambda o, call, selection: o.iff(o.is_null(call), o.is_null(selection)),
            message="terminal_call_id and terminal_selection must be set together",
        ),
        reasons("terminal_attribution_reason", optional=True),
        _when_ok(
            "ok_names_terminal_call", "terminal_call_id", lambda o, call: o.not_null(call), "names no terminal call"
        ),
        _when_ok(
            "ok_has_no_failure_reason",
            "failure_reason",
            lambda o, reason: o.is_null(reason),
            "has failure_reason {failure_reason!r}",
        ),
        _when_ok("ok_has_reward", "reward", lambda o, reward: o.not_null(reward), "has no reward"),
        _when_ok("ok_has_calls", "num_calls", lambda o, calls: o.ge(calls, 1), "has no calls"),
        Rule(
            name="not_ok_names_failure_reason",
            fields=("status", "failure_reason"),
            predicate=lambda o, status, reason: o.any_of(o.eq(status, "ok"), o.matches(reason, REASON_NAME)),
            message="receipt of {rollout_id} is {status} but names no failure_reason "
            "(a snake_case reason name), got {failure_reason!r}",
        ),
    )

    def __post_init__(self) -> None:
        self.rules.check(self)
