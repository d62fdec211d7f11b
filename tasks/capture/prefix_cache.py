"""Parent tokens of a child call, resolved from its staging chain (docs/architecture.md §5, step 2).

A child call continues from its parent's exact tokens: the concatenated deltas of the chain
root→parent. :class:`ChainPrefixCache` keeps the whole prefix of recently resolved chains, keyed
by the chain's last staging key, so each turn reads only the deltas staged since the last one.
:func:`resolve_admission` checks the admission's shape and that the resolved prefix has exactly
``prev_len`` tokens: a call is never generated on tokens other than its parent's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tasks.checks import check_hex_digest, check_int
from tasks.ids import check_id, check_optional_id

FetchDeltas = Callable[[Sequence[str]], Sequence[np.ndarray]]
DEFAULT_MAX_ENTRIES = 256


class ChainPrefixCache:
    """Whole-chain token prefixes keyed by the chain's last staging key.

    At most ``max_entries`` prefixes are kept; the oldest insertion is evicted first (a hit
    does not refresh an entry). Every prefix belongs to one source (``source_id``, e.g. a
    batch's staging area); switching to another source clears the cache. Returned arrays are
    read-only int64. Safe to share between threads; a fetch runs outside the lock.
    """

    def __init__(
        self,
        fetch_deltas: FetchDeltas | None = None,
        *,
        source_id: str | None = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        check_int(max_entries, field="max_entries", minimum=1, error=ValueError)
        self._max_entries = max_entries
        self._source_id = source_id
        self._fetch_deltas = fetch_deltas
        self._prefixes: dict[str, np.ndarray] = {}
        self._generation = 0
        self._lock = threading.Lock()

    @property
    def source_id(self) -> str | None:
        return self._source_id

    def __len__(self) -> int:
        return len(self._prefixes)

    def __contains__(self, staging_key: object) -> bool:
        return staging_key in self._prefixes

    def set_source(self, source_id: str, fetch_deltas: FetchDeltas) -> None:
        """Read deltas through ``fetch_deltas`` from now on; a different ``source_id`` clears the cache."""
        with self._lock:
            if source_id != self._source_id:
                self._prefixes.clear()
                self._generation += 1
            self._source_id = source_id
            self._fetch_deltas = fetch_deltas

    def get_prefix(self, chain: Sequence[str]) -> np.ndarray:
        """Tokens of the whole chain (staging keys root→last), reading only the uncached suffix.

        The longest cached prefix of the chain is extended with the deltas of the remaining keys,
        fetched in one call in chain order; the result is cached under the chain's last key.
        """
        keys = list(chain)
        if not keys:
            return _EMPTY
        if len(set(keys)) != len(keys):
            raise ValueError(f"staging chain ending at {keys[-1]!r} repeats a key: {keys}")
        with self._lock:
            fetch, generation = self._fetch_deltas, self._generation
            start, base = 0, _EMPTY
            for index in range(len(keys) - 1, -1, -1):
                cached = self._prefixes.get(keys[index])
                if cached is not None:
                    start, base = index + 1, cached
                    break
        if start == len(keys):
            return base
        if fetch is None:
            raise RuntimeError("ChainPrefixCache has no source: call set_source(source_id, fetch_deltas) first")
        missing = keys[start:]
        deltas = fetch(missing)
        if len(deltas) != len(missing):
            raise ValueError(f"fetch_deltas returned {len(deltas)} deltas for {len(missing)} staging keys")
        prefix = np.concatenate([base, *(_delta_array(key, delta) for key, delta in zip(missing, deltas, strict=True))])
        prefix.setflags(write=False)
        with self._lock:
            if generation == self._generation:
                self._insert(keys[-1], prefix)
        return prefix

    def cached_prefix(self, chain: Sequence[str]) -> np.ndarray | None:
        """The whole chain's tokens when they are cached under its last key, else ``None`` (never fetches)."""
        keys = list(chain)
        if not keys:
            return _EMPTY
        with self._lock:
            return self._prefixes.get(keys[-1])

    def remember(self, staging_key: str, prefix: np.ndarray) -> None:
        """Write-through: cache the whole sequence of a call whose delta was just staged.

        The caller guarantees ``prefix`` is exactly what the chain ending at ``staging_key``
        stages (it built the delta from it), so the next turn resolves without a staging read.
        """
        arr = np.array(prefix, dtype=np.int64)
        arr.setflags(write=False)
        with self._lock:
            self._insert(staging_key, arr)

    def _insert(self, key: str, prefix: np.ndarray) -> None:
        if key in self._prefixes:
            return
        while len(self._prefixes) >= self._max_entries:
            del self._prefixes[next(iter(self._prefixes))]
        self._prefixes[key] = prefix


class AdmissionError(ValueError):
    """A call's admission cannot be honoured; ``reason`` names why (a stable string)."""

    reason = "invalid_admission"


class PrefixMismatchError(AdmissionError):
    """The resolved parent tokens do not have the length the admission promised."""

    reason = "prefix_mismatch"


@dataclass(frozen=True)
class Admission:
    """What a call is admitted with: a root (no parent) or a token_in child of ``parent_call_id``.

    root: no parent, ``prev_len`` 0, empty chain, no parent chain hash. token_in: a parent,
    ``prev_len`` > 0 (the parent's cum_len), the staging chain root→parent ending at the
    parent's key, and the parent's chain hash.
    """

    call_id: str
    parent_call_id: str | None = None
    prev_len: int = 0
    staging_chain: tuple[str, ...] = ()
    parent_chain_hash: str | None = None

    def __post_init__(self) -> None:
        try:
            check_id(self.call_id, field="call_id")
            check_optional_id(self.parent_call_id, field="parent_call_id")
            if self.parent_chain_hash is not None:
                check_hex_digest(self.parent_chain_hash, field="parent_chain_hash")
            if isinstance(self.staging_chain, str):
                raise TypeError("staging_chain must be a sequence of staging keys, got a str")
            chain = tuple(self.staging_chain)
            for key in chain:
                rollout, _, call = str(key).partition("/")
                check_id(rollout, field="staging_chain rollout_id")
                check_id(call, field="staging_chain call_id")
        except (TypeError, ValueError) as exc:
            raise AdmissionError(f"admission of {self.call_id!r}: {exc}") from None
        object.__setattr__(self, "staging_chain", chain)
        check_int(self.prev_len, field=f"admission of {self.call_id}: prev_len", error=AdmissionError)
        if self.parent_call_id is None:
            if self.prev_len or chain or self.parent_chain_hash is not None:
                raise AdmissionError(
                    f"admission of root {self.call_id} must have prev_len 0, an empty staging chain and no "
                    f"parent chain hash (got prev_len {self.prev_len}, {len(chain)} chain keys, "
                    f"parent_chain_hash {self.parent_chain_hash!r})"
                )
            return
        if self.prev_len == 0:
            raise AdmissionError(f"admission of child {self.call_id} must have prev_len > 0 (its parent's cum_len)")
        if not chain or chain[-1].partition("/")[2] != self.parent_call_id:
            raise AdmissionError(
                f"admission of child {self.call_id}: staging chain must end at parent {self.parent_call_id}, "
                f"got last key {chain[-1] if chain else None!r}"
            )
        if self.parent_chain_hash is None:
            raise AdmissionError(f"admission of child {self.call_id} has no parent chain hash")

    @property
    def is_root(self) -> bool:
        return self.parent_call_id is None


def resolve_admission(admission: Admission, cache: ChainPrefixCache) -> np.ndarray:
    """The parent's exact tokens for ``admission`` (empty for a root); length must be ``prev_len``."""
    if admission.is_root:
        return _EMPTY
    prefix = cache.get_prefix(admission.staging_chain)
    if prefix.size != admission.prev_len:
        raise PrefixMismatchError(
            f"call {admission.call_id}: parent {admission.parent_call_id} resolved to {prefix.size} tokens, "
            f"admission expects prev_len {admission.prev_len}"
        )
    return prefix


def resolve_cached_admission(admission: Admission, cache: ChainPrefixCache) -> np.ndarray | None:
    """:func:`resolve_admission` from memory only: ``None`` when the parent's prefix is not cached.

    Cheap (a dict lookup), so an event loop can call it inline and hand only misses, which read
    staging, to a thread. The same checks as :func:`resolve_admission` apply to a hit.
    """
    if admission.is_root:
        return _EMPTY
    prefix = cache.cached_prefix(admission.staging_chain)
    if prefix is None:
        return None
    if prefix.size != admission.prev_len:
        raise PrefixMismatchError(
            f"call {admission.call_id}: parent {admission.parent_call_id} resolved to {prefix.size} tokens, "
            f"admission expects prev_len {admission.prev_len}"
        )
    return prefix


def _delta_array(key: str, delta: np.ndarray | Sequence[int]) -> np.ndarray:
    arr = np.asarray(delta)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"delta of {key} must be a flat array of integer token ids, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _I64_MAX):
        raise ValueError(f"delta of {key} holds a token id outside [0, 2**63)")
    return arr.astype(np.int64, copy=False)


_I64_MAX = 2**63 - 1
_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)
