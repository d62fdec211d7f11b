"""Staging digests, wire-compatible with NeMo Gym staging digest v2 (docs/architecture.md §4.2).

Pure functions over a fixed byte encoding: integers are unsigned 64-bit big-endian, text is
length-prefixed UTF-8, token lists are ``>Q`` count + ``>Q`` ids, float lists are ``>Q`` count
+ ``>f`` values. Every input is checked before it is encoded, so a digest is never computed
over a value that the staged Parquet row could not hold byte-exactly (float32, uint64).
Every function returns lowercase hex.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from tasks.checks import U64_MAX, check_hex_digest, check_text, check_u64

SCHEMA_VERSION = 2
DIGEST_VERSION = 2
EXTRAS_DIGEST_VERSION = 1

CALL_DOMAIN = b"nemo-gym-staging-call-v2"
EXTRAS_DOMAIN = b"nemo-gym-staging-extras-v1"
PREFIX_DOMAIN = b"nemo-gym-staging-prefix-v2"
CHAIN_DOMAIN = b"rollout-ledger-chain-v1"

MODES = ("text", "token_in")
_U64 = struct.Struct(">Q")
_LENGTHS = struct.Struct(">QQQQ")
# Values already in their wire byte order (``>u8`` ids, ``>f4`` floats), hashed as they are.
WireBuffer = bytes | memoryview | np.ndarray
_F32_MAX = float(np.finfo(np.float32).max)
_CALL_HEAD = CALL_DOMAIN + struct.pack(">BBB", SCHEMA_VERSION, DIGEST_VERSION, EXTRAS_DIGEST_VERSION)
_ROOT_LINK = CHAIN_DOMAIN + b"\x00"
_CHILD_LINK = CHAIN_DOMAIN + b"\x01"
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


# --- checks -------------------------------------------------------------------------------


def token_array(ids: Sequence[int] | np.ndarray, *, field: str) -> np.ndarray:
    """Token ids as a uint64 array; refuses floats, bools, negatives and values past uint64."""
    if not isinstance(ids, np.ndarray):
        ids = list(ids)
        if any(type(v) is not int and not isinstance(v, np.integer) for v in ids):
            bad = next(v for v in ids if type(v) is not int and not isinstance(v, np.integer))
            raise TypeError(f"{field} must hold ints only, got {type(bad).__name__} {bad!r}")
        try:
            arr = np.asarray(ids, dtype=np.int64)
        except OverflowError:
            if min(ids) < 0 or max(ids) > U64_MAX:
                raise ValueError(f"{field} holds a token id outside [0, 2**64)") from None
            return np.asarray(ids, dtype=np.uint64)
    else:
        arr = ids
    if arr.ndim != 1:
        raise ValueError(f"{field} must be a flat list of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if arr.dtype.kind == "u":
        return arr.astype(np.uint64, copy=False)
    if arr.dtype.kind != "i":
        raise TypeError(f"{field} must hold ints, got dtype {arr.dtype}")
    if arr.min() < 0:
        raise ValueError(f"{field} holds a negative token id ({int(arr.min())})")
    return arr.astype(np.int64, copy=False).view(np.uint64)


def float32_array(values: Sequence[float] | np.ndarray, *, field: str) -> np.ndarray:
    """Values as float32 (a float32 array as it is); refuses non-numbers, NaN/inf and float32 overflow."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{field} must be a flat list of floats, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "fiu":
        raise TypeError(f"{field} must hold numbers, got dtype {arr.dtype}")
    if arr.size and not np.isfinite(arr).all():
        raise ValueError(f"{field} holds NaN or infinity")
    if arr.dtype == np.float32:
        return arr
    # Checked before the cast (no np.errstate, which costs more than the check), so it cannot overflow.
    if arr.size and float(np.abs(arr).max()) > _F32_MAX:
        raise ValueError(f"{field} holds a value that overflows float32")
    return arr.astype(np.float32)


# --- encodings ----------------------------------------------------------------------------


def _u64(value: int) -> bytes:
    return _U64.pack(value)


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _u64(len(raw)) + raw


def _opt_text(value: str | None) -> bytes:
    return b"\x00" if value is None else b"\x01" + _text(value)


def _opt_digest(value: str | None) -> bytes:
    return b"\x00" if value is None else b"\x01" + bytes.fromhex(value)


def _encode_extras_value(value: Any, path: str, out: list[bytes]) -> None:
    # bool before int: bool is an int subclass in Python.
    if value is None:
        out.append(b"N")
    elif type(value) is bool:
        out.append(b"B\x01" if value else b"B\x00")
    elif type(value) is int:
        if not _I64_MIN <= value <= _I64_MAX:
            raise ValueError(f"extras{path}: int {value} does not fit a signed 64-bit integer")
        out.append(b"I" + struct.pack(">q", value))
    elif type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"extras{path}: {value!r} is not a finite float")
        out.append(b"F" + struct.pack(">d", value))
    elif type(value) is str:
        out.append(b"S" + _text(value))
    elif type(value) is list:
        out.append(b"L" + _u64(len(value)))
        for index, item in enumerate(value):
            _encode_extras_value(item, f"{path}[{index}]", out)
    elif type(value) is dict:
        keys = list(value)
        for key in keys:
            if type(key) is not str:
                raise TypeError(f"extras{path}: dict key {key!r} is not a str")
        out.append(b"D" + _u64(len(keys)))
        for key in sorted(keys, key=lambda k: k.encode("utf-8")):
            out.append(_text(key))
            _encode_extras_value(value[key], f"{path}[{key!r}]", out)
    else:
        raise TypeError(
            f"extras{path}: {type(value).__name__} is not allowed "
            "(use None, bool, int, float, str, list or dict with str keys)"
        )


# --- public digests -----------------------------------------------------------------------


def compute_extras_digest(extras: Any) -> str:
    """Digest of the decoded extras value (dict / list / scalar / None), not of a JSON string."""
    parts: list[bytes] = [EXTRAS_DOMAIN, struct.pack(">B", EXTRAS_DIGEST_VERSION)]
    _encode_extras_value(extras, "", parts)
    return hashlib.sha256(b"".join(parts)).hexdigest()


def hash_token_ids(ids: Sequence[int] | np.ndarray) -> str:
    """Cumulative hash: the whole token sequence through a call."""
    return cumulative_hash_of_parts(token_array(ids, field="token_ids"))


def cumulative_hash_of_parts(*parts: np.ndarray) -> str:
    """Cumulative hash of the concatenation of checked uint64 arrays, streamed without joining them."""
    return cumulative_hash_of_encoded(
        sum(part.size for part in parts), *(part.astype(">u8", copy=False) for part in parts)
    )


def cumulative_hash_of_encoded(count: int, *parts: WireBuffer) -> str:
    """Cumulative hash of ``count`` ids given as big-endian (``>u8``) buffers, in order."""
    hasher = hashlib.sha256(PREFIX_DOMAIN)
    hasher.update(_u64(count))
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


def chain_hash(parent_chain_hash: str | None, delta_ids: Sequence[int] | np.ndarray) -> str:
    """Chain hash of a call: its parent's chain hash (``None`` for a root) + its delta ids."""
    if parent_chain_hash is not None:
        check_hex_digest(parent_chain_hash, field="parent_chain_hash")
    return chain_hash_of_checked(parent_chain_hash, token_array(delta_ids, field="delta_ids"))


def chain_hash_of_checked(parent_chain_hash: str | None, ids: np.ndarray) -> str:
    """Chain hash for an already checked parent hash and uint64 delta ids."""
    return chain_hash_of_encoded(parent_chain_hash, ids.size, ids.astype(">u8", copy=False))


def chain_hash_of_encoded(parent_chain_hash: str | None, count: int, ids: WireBuffer) -> str:
    """Chain hash for a checked parent hash and ``count`` delta ids as a big-endian buffer."""
    link = _ROOT_LINK if parent_chain_hash is None else _CHILD_LINK + bytes.fromhex(parent_chain_hash)
    hasher = hashlib.sha256(link + _u64(count))
    hasher.update(ids)
    return hasher.hexdigest()


def compute_staging_digest(
    *,
    rollout_id: str,
    call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Sequence[int] | np.ndarray,
    token_mask_delta: Sequence[float] | np.ndarray,
    logprobs_delta: Sequence[float] | np.ndarray,
    extras_digest: str,
    chain_hash: str | None,
    cumulative_hash: str | None,
    schema_version: int = SCHEMA_VERSION,
    digest_version: int = DIGEST_VERSION,
    extras_digest_version: int = EXTRAS_DIGEST_VERSION,
) -> str:
    """The call digest over exactly the fields of docs/architecture.md §4.2, after checking that each one encodes.

    Only what the encoding needs is checked (types, uint64 ranges, float32 values, hex digests,
    one length for the three lists); the rules a staged delta's fields obey together (root or
    child, ``cum_len``, masks) are its record's (``StagedDelta.rules``).
    """
    for name, value, expected in (
        ("schema_version", schema_version, SCHEMA_VERSION),
        ("digest_version", digest_version, DIGEST_VERSION),
        ("extras_digest_version", extras_digest_version, EXTRAS_DIGEST_VERSION),
    ):
        if type(value) is not int or value != expected:
            raise ValueError(f"{name} must be {expected}, got {value!r}")
    for name, text in (("rollout_id", rollout_id), ("call_id", call_id), ("mode", mode)):
        check_text(text, field=name)
    if parent_call_id is not None:
        check_text(parent_call_id, field="parent_call_id")
    prev_len = check_u64(prev_len, field="prev_len")
    delta_len = check_u64(delta_len, field="delta_len")
    cum_len = check_u64(cum_len, field="cum_len")
    weight_version = check_u64(weight_version, field="weight_version")
    ids = token_array(token_ids_delta, field="token_ids_delta")
    mask = float32_array(token_mask_delta, field="token_mask_delta")
    logprobs = float32_array(logprobs_delta, field="logprobs_delta")
    if not ids.size == mask.size == logprobs.size:
        raise ValueError(
            f"token_ids_delta, token_mask_delta and logprobs_delta hold {ids.size}, {mask.size} and "
            f"{logprobs.size} entries: the digest frames all three with one count"
        )
    check_hex_digest(extras_digest, field="extras_digest")
    if chain_hash is not None:
        check_hex_digest(chain_hash, field="chain_hash")
    if cumulative_hash is not None:
        check_hex_digest(cumulative_hash, field="cumulative_hash")
    return digest_of_checked_call(
        rollout_id=rollout_id,
        call_id=call_id,
        parent_call_id=parent_call_id,
        mode=mode,
        prev_len=prev_len,
        delta_len=delta_len,
        cum_len=cum_len,
        weight_version=weight_version,
        ids=ids,
        mask=mask,
        logprobs=logprobs,
        extras_digest=extras_digest,
        chain_hash=chain_hash,
        cumulative_hash=cumulative_hash,
    )


def digest_of_checked_call(
    *,
    rollout_id: str,
    call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    ids: np.ndarray,
    mask: np.ndarray,
    logprobs: np.ndarray,
    extras_digest: str,
    chain_hash: str | None,
    cumulative_hash: str | None,
) -> str:
    """The call digest encoding alone, for callers that already checked every field.

    Verifiers use it to recompute the digest of a stored row exactly as stored, so a
    malformed row yields a mismatch rather than an exception.
    """
    return digest_of_encoded_call(
        rollout_id=rollout_id,
        call_id=call_id,
        parent_call_id=parent_call_id,
        mode=mode,
        lengths=(prev_len, delta_len, cum_len, weight_version),
        count=ids.size,
        ids=ids.astype(">u8", copy=False),
        mask=mask.astype(">f4", copy=False),
        logprobs=logprobs.astype(">f4", copy=False),
        extras_digest=extras_digest,
        chain_hash=chain_hash,
        cumulative_hash=cumulative_hash,
    )


def digest_of_encoded_call(
    *,
    rollout_id: str,
    call_id: str,
    parent_call_id: str | None,
    mode: str,
    lengths: tuple[int, int, int, int],
    count: int,
    ids: WireBuffer,
    mask: WireBuffer,
    logprobs: WireBuffer,
    extras_digest: str,
    chain_hash: str | None,
    cumulative_hash: str | None,
) -> str:
    """The one encoder of the call digest: checked scalars, ``count`` list entries as wire buffers.

    ``lengths`` is ``(prev_len, delta_len, cum_len, weight_version)``; ``ids`` holds ``>u8``
    and ``mask`` / ``logprobs`` ``>f4`` values. Single rows and batched verifiers both end here.
    """
    floats = _u64(8 + 4 * count) + _u64(count)
    # The small fields are joined; the token buffers are hashed where they lie, never copied.
    hasher = hashlib.sha256(
        b"".join(
            (
                _CALL_HEAD,
                _text(rollout_id),
                _text(call_id),
                _opt_text(parent_call_id),
                _text(mode),
                _LENGTHS.pack(*lengths),
                _u64(8 + 8 * count),
                _u64(count),
            )
        )
    )
    hasher.update(ids)
    hasher.update(floats)
    hasher.update(mask)
    hasher.update(floats)
    hasher.update(logprobs)
    hasher.update(bytes.fromhex(extras_digest) + _opt_digest(chain_hash) + _opt_digest(cumulative_hash))
    return hasher.hexdigest()
