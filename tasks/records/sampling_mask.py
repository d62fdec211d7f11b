"""The sampling mask of a call: for each token it sampled, the token ids its sampler kept (top-p, top-k).

With truncated sampling (``top_p < 1`` or ``top_k > 0``) the sampler draws each token from the
tokens it kept, renormalized: the sampled token's logprob is ``log(p / S)`` with ``S`` the kept
mass. A trainer must renormalize over the same kept set to compute ratios against it
(docs/finalization.md, "The off-policy gate"); that set is what a :class:`KeptSets` records, per
sampled token, as CSR: ``counts[i]`` ids for the ``i``-th sampled token, all of them one after
another in ``token_ids``, each set ascending.

Invariants (:meth:`KeptSets.check`): one count per sampled token, each at least 1, the ids as many
as the counts add up to, each set strictly ascending with ids in ``[0, 2**31)``, and each sampled
token in its own set. :meth:`KeptSets.digest` is the SHA-256 of that encoding under its own
domain; a staged delta names it in its extras (``{"sampling": {"kept_sha256": ...}}``), which the
call digest covers, so the chain hash covers the mask. An empty :class:`KeptSets` is a call that
did not truncate: it names nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

KEPT_DOMAIN = b"rollout-ledger-sampling-mask-v1"
KEPT_NOTE = "sampling"  # the key of a staged delta's extras that names its kept sets' digest
KEPT_DIGEST_KEY = "kept_sha256"
MAX_ID = 2**31 - 1


@dataclass(frozen=True, eq=False)
class KeptSets:
    """Per sampled token of one call, the ids its sampler kept (CSR: ``counts`` then ``token_ids``)."""

    counts: np.ndarray  # int32, one per sampled token
    token_ids: np.ndarray  # int32, counts.sum() of them

    @classmethod
    def empty(cls) -> KeptSets:
        return cls(np.zeros(0, np.int32), np.zeros(0, np.int32))

    @classmethod
    def of(cls, sets: Iterable[Iterable[int]]) -> KeptSets:
        """From one iterable of kept ids per sampled token (each sorted here)."""
        arrays = [np.unique(np.fromiter(kept, np.int64)) for kept in sets]
        counts = np.array([a.size for a in arrays], np.int32)
        ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() > MAX_ID):
            raise ValueError(f"kept token ids must be in [0, {MAX_ID}]")
        return cls(counts, ids.astype(np.int32))

    def __bool__(self) -> bool:
        return bool(self.counts.size)

    def __len__(self) -> int:
        return int(self.counts.size)

    def sets(self) -> list[np.ndarray]:
        """The kept ids of each sampled token, in order."""
        return np.split(self.token_ids, np.cumsum(self.counts)[:-1]) if self.counts.size else []

    def check(self, sampled: Sequence[int] | np.ndarray) -> None:
        """Raise ValueError naming the first broken invariant (module docstring) for these ``sampled`` tokens."""
        counts, ids = np.asarray(self.counts), np.asarray(self.token_ids)
        if counts.dtype != np.int32 or ids.dtype != np.int32 or counts.ndim != 1 or ids.ndim != 1:
            raise ValueError("kept sets must be two 1-d int32 arrays (counts, token ids)")
        sampled = np.asarray(sampled, np.int64)
        if counts.size != sampled.size:
            raise ValueError(f"kept sets hold {counts.size} counts for {sampled.size} sampled tokens")
        if counts.size and counts.min() < 1:
            raise ValueError("every sampled token keeps at least one id (itself)")
        if int(counts.sum(dtype=np.int64)) != ids.size:
            raise ValueError(f"kept counts add up to {int(counts.sum())}, but {ids.size} kept ids are stored")
        if ids.size and ids.min() < 0:
            raise ValueError("kept token ids must be >= 0")
        # One key per kept id, (set index, id): strictly rising over the whole array iff each set is strictly
        # ascending, and a sampled token is in its set iff its own key is among them.
        position = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
        keys = position * (MAX_ID + 1) + ids.astype(np.int64)
        if keys.size > 1 and not (np.diff(keys) > 0).all():
            raise ValueError("each kept set must be strictly ascending")
        wanted = np.arange(sampled.size, dtype=np.int64) * (MAX_ID + 1) + sampled
        found = np.minimum(np.searchsorted(keys, wanted), max(keys.size - 1, 0))
        missing = (sampled < 0) | (sampled > MAX_ID)
        if keys.size:
            missing |= keys[found] != wanted
        if missing.any():
            i = int(np.argmax(missing))
            raise ValueError(f"sampled token {i} ({int(sampled[i])}) is not in its own kept set")

    def digest(self) -> str:
        """SHA-256 (hex) of the sets under :data:`KEPT_DOMAIN`: ``>Q`` count of sets, ``>u4`` counts, ``>u4`` ids."""
        hasher = hashlib.sha256(KEPT_DOMAIN)
        hasher.update(len(self.counts).to_bytes(8, "big"))
        hasher.update(np.asarray(self.counts, ">u4").tobytes())
        hasher.update(np.asarray(self.token_ids, ">u4").tobytes())
        return hasher.hexdigest()

    def note(self) -> dict[str, str]:
        """What a staged delta's extras say of these sets under :data:`KEPT_NOTE` (nothing for a call that did not
        truncate)."""
        return {KEPT_DIGEST_KEY: self.digest()} if self else {}
