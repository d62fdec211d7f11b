"""Digests of many staged rows at once, byte-identical to :mod:`tasks.records.digest`.

The token lists of every row are converted to their big-endian wire encoding once
(:class:`FlatTokens`), and each row's digest hashes zero-copy slices of those buffers through
the same encoders the per-row functions use (``digest.*_of_encoded``), so the per-row cost is
one SHA-256 over the row's bytes plus a few small headers. Like
``digest_of_checked_call`` and ``chain_hash_of_checked``, every function here trusts its
inputs: ids are uint64, mask and logprobs float32, hex digests are 64 hex characters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tasks.records import digest as dg

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


def call_digests(tokens: FlatTokens, scalars: Mapping[str, Sequence], rows: Sequence[int]) -> list[str]:
    """The call digest (``digest_of_checked_call``) of each of ``rows``.

    ``scalars`` maps every name of :data:`CALL_DIGEST_FIELDS` to a per-row sequence indexed
    like ``tokens``; the digest's list lengths are the rows' token counts.
    """
    rollout_id, call_id, parent, mode = (scalars[k] for k in ("rollout_id", "call_id", "parent_call_id", "mode"))
    prev_len, delta_len, cum_len, version = (scalars[k] for k in ("prev_len", "delta_len", "cum_len", "weight_version"))
    extras, chain, cumulative = (scalars[k] for k in ("extras_digest", "chain_hash", "cumulative_hash"))
    starts = tokens.starts.tolist()
    digest = dg.digest_of_encoded_call
    out = []
    for i in rows:
        lo, hi = starts[i], starts[i + 1]
        out.append(
            digest(
                rollout_id=rollout_id[i],
                call_id=call_id[i],
                parent_call_id=parent[i],
                mode=mode[i],
                lengths=(prev_len[i], delta_len[i], cum_len[i], version[i]),
                count=hi - lo,
                ids=tokens.ids[8 * lo : 8 * hi],
                mask=tokens.mask[4 * lo : 4 * hi],
                logprobs=tokens.logprobs[4 * lo : 4 * hi],
                extras_digest=extras[i],
                chain_hash=chain[i],
                cumulative_hash=cumulative[i],
            )
        )
    return out


def chain_hashes(tokens: FlatTokens, parents: Sequence[str | None], rows: Sequence[int]) -> list[str]:
    """The chain hash (``chain_hash_of_checked``) of each of ``rows`` given its parent's chain hash.

    ``parents[k]`` is the parent chain hash of ``rows[k]`` (None for a root).
    """
    starts = tokens.starts.tolist()
    chain = dg.chain_hash_of_encoded
    out = []
    for parent, i in zip(parents, rows, strict=True):
        lo, hi = starts[i], starts[i + 1]
        out.append(chain(parent, hi - lo, tokens.ids[8 * lo : 8 * hi]))
    return out


def cumulative_hash(tokens: FlatTokens, first_row: int, end_row: int) -> str:
    """The cumulative hash (``hash_token_ids``) of the ids of rows ``first_row`` to ``end_row - 1`` joined."""
    lo, hi = int(tokens.starts[first_row]), int(tokens.starts[end_row])
    return dg.cumulative_hash_of_encoded(hi - lo, tokens.ids[8 * lo : 8 * hi])
