"""Digests of many staged rows at once, byte-identical to :mod:`tasks.capture.digest`.

The token lists of every row are converted to their big-endian wire encoding once
(:class:`FlatTokens`), and each row's digest hashes zero-copy slices of those buffers, so the
per-row cost is one SHA-256 over the row's bytes plus a few small headers. Like
``digest_of_checked_call`` and ``chain_hash_of_checked``, every function here trusts its
inputs: ids are uint64, mask and logprobs float32, hex digests are 64 hex characters.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tasks.capture import digest as dg

_U64 = struct.Struct(">Q")
_LENGTHS = struct.Struct(">QQQQ")
_CALL_HEAD = dg.CALL_DOMAIN + struct.pack(">BBB", dg.SCHEMA_VERSION, dg.DIGEST_VERSION, dg.EXTRAS_DIGEST_VERSION)
_ROOT_LINK = dg.CHAIN_DOMAIN + b"\x00"
_CHILD_LINK = dg.CHAIN_DOMAIN + b"\x01"

# The per-row scalars a call digest covers, by their staged-column names.
CALL_DIGEST_FIELDS = (
    "rollout_id",
    "call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)


@dataclass(frozen=True)
class FlatTokens:
    """The token deltas of many rows laid end to end, in wire byte order.

    Row ``i`` holds tokens ``starts[i]:starts[i + 1]`` of each list; ``ids`` (``>u8``),
    ``mask`` and ``logprobs`` (``>f4``) are byte views of buffers converted once.
    """

    starts: np.ndarray
    ids: memoryview
    mask: memoryview
    logprobs: memoryview

    @classmethod
    def of(cls, ids: np.ndarray, mask: np.ndarray, logprobs: np.ndarray, starts: np.ndarray) -> FlatTokens:
        """``ids`` uint64, ``mask`` / ``logprobs`` float32, equally long; ``starts`` row offsets plus the total."""
        if not ids.size == mask.size == logprobs.size == int(starts[-1]):
            raise ValueError(f"flat lists of {ids.size}/{mask.size}/{logprobs.size} tokens, starts end at {starts[-1]}")
        return cls(
            starts=np.asarray(starts, dtype=np.int64),
            ids=_bytes_view(ids.astype(">u8")),
            mask=_bytes_view(mask.astype(">f4")),
            logprobs=_bytes_view(logprobs.astype(">f4")),
        )

    @property
    def rows(self) -> int:
        return self.starts.size - 1


def _bytes_view(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array)).cast("B")


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _U64.pack(len(raw)) + raw


def call_digests(tokens: FlatTokens, scalars: Mapping[str, Sequence], rows: Sequence[int]) -> list[str]:
    """The call digest (``digest_of_checked_call``) of each of ``rows``.

    ``scalars`` maps every name of :data:`CALL_DIGEST_FIELDS` to a per-row sequence indexed
    like ``tokens``; the digest's list lengths are the rows' token counts.
    """
    rollout_id, call_id, parent, mode = (scalars[k] for k in ("rollout_id", "call_id", "parent_call_id", "mode"))
    prev_len, delta_len, cum_len, version = (scalars[k] for k in ("prev_len", "delta_len", "cum_len", "weight_version"))
    extras, chain, cumulative = (scalars[k] for k in ("extras_digest", "chain_hash", "cumulative_hash"))
    starts = tokens.starts.tolist()
    pack_u64, pack_lengths, sha256 = _U64.pack, _LENGTHS.pack, hashlib.sha256
    out = []
    for i in rows:
        lo, hi = starts[i], starts[i + 1]
        n = hi - lo
        floats = pack_u64(8 + 4 * n) + pack_u64(n)
        parent_id, chain_i, cumulative_i = parent[i], chain[i], cumulative[i]
        blob = b"".join(
            (
                _CALL_HEAD,
                _text(rollout_id[i]),
                _text(call_id[i]),
                b"\x00" if parent_id is None else b"\x01" + _text(parent_id),
                _text(mode[i]),
                pack_lengths(prev_len[i], delta_len[i], cum_len[i], version[i]),
                pack_u64(8 + 8 * n),
                pack_u64(n),
                tokens.ids[8 * lo : 8 * hi],
                floats,
                tokens.mask[4 * lo : 4 * hi],
                floats,
                tokens.logprobs[4 * lo : 4 * hi],
                bytes.fromhex(extras[i]),
                b"\x00" if chain_i is None else b"\x01" + bytes.fromhex(chain_i),
                b"\x00" if cumulative_i is None else b"\x01" + bytes.fromhex(cumulative_i),
            )
        )
        out.append(sha256(blob).hexdigest())
    return out


def chain_hashes(tokens: FlatTokens, parents: Sequence[str | None], rows: Sequence[int]) -> list[str]:
    """The chain hash (``chain_hash_of_checked``) of each of ``rows`` given its parent's chain hash.

    ``parents[k]`` is the parent chain hash of ``rows[k]`` (None for a root).
    """
    starts = tokens.starts.tolist()
    pack_u64, sha256 = _U64.pack, hashlib.sha256
    out = []
    for parent, i in zip(parents, rows, strict=True):
        lo, hi = starts[i], starts[i + 1]
        link = _ROOT_LINK if parent is None else _CHILD_LINK + bytes.fromhex(parent)
        hasher = sha256(link + pack_u64(hi - lo))
        hasher.update(tokens.ids[8 * lo : 8 * hi])
        out.append(hasher.hexdigest())
    return out


def cumulative_hash(tokens: FlatTokens, first_row: int, end_row: int) -> str:
    """The cumulative hash (``hash_token_ids``) of the ids of rows ``first_row`` to ``end_row - 1`` joined."""
    lo, hi = int(tokens.starts[first_row]), int(tokens.starts[end_row])
    hasher = hashlib.sha256(dg.PREFIX_DOMAIN + _U64.pack(hi - lo))
    hasher.update(tokens.ids[8 * lo : 8 * hi])
    return hasher.hexdigest()
