"""Identifier rules and deterministic ids (docs/architecture.md §3).

Every id that reaches a storage path passes through :func:`check_id`, so no id can
traverse out of its directory or collide with a separator.
"""

from __future__ import annotations

import hashlib
import re

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_ID_LENGTH = 128
# Ids already checked (batch and rollout ids recur on every call): validity is a pure function of the value.
_RECENT_VALID: set[str] = set()
_RECENT_VALID_MAX = 65536


def is_id(value: object) -> bool:
    """Whether ``value`` is a valid id: a str of the id charset, at most :data:`MAX_ID_LENGTH` characters."""
    if value.__class__ is str and value in _RECENT_VALID:
        return True
    if not isinstance(value, str) or len(value) > MAX_ID_LENGTH or not ID_PATTERN.fullmatch(value):
        return False
    if len(_RECENT_VALID) >= _RECENT_VALID_MAX:
        _RECENT_VALID.clear()
    _RECENT_VALID.add(value)
    return True


def check_id(value: object, *, field: str) -> str:
    """Return ``value`` when it is a valid id, else raise naming ``field`` and the value."""
    if is_id(value):
        return value  # type: ignore[return-value]
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__}: {value!r}")
    if len(value) > MAX_ID_LENGTH:
        raise ValueError(f"{field} is {len(value)} characters, at most {MAX_ID_LENGTH} allowed: {value[:40]!r}...")
    raise ValueError(f"{field} {value!r} is not a valid id: use [A-Za-z0-9][A-Za-z0-9._-]*")


def check_optional_id(value: object, *, field: str) -> str | None:
    """Like :func:`check_id`, but ``None`` passes through (a root call's parent)."""
    return None if value is None else check_id(value, field=field)


def rollout_id(task_index: int, sample_index: int) -> str:
    """Deterministic rollout id from its task and its sample index within the group."""
    _check_index(task_index, "task_index")
    _check_index(sample_index, "sample_index")
    return f"r{task_index:06d}-{sample_index:02d}"


def group_id(task_index: int) -> str:
    """The group of a rollout is its task."""
    _check_index(task_index, "task_index")
    return f"g{task_index:06d}"


def call_id(rollout: str, attempt: int, ordinal: int) -> str:
    """Deterministic call id within an attempt: ``{rollout}.a{attempt:02d}.c{ordinal:03d}``.

    A retried model call inside a rollout takes the next ordinal (a sibling), never the same id.
    """
    check_id(rollout, field="rollout_id")
    _check_index(attempt, "attempt")
    _check_index(ordinal, "ordinal")
    return check_id(f"{rollout}.a{attempt:02d}.c{ordinal:03d}", field="call_id")


def staging_key(rollout: str, call: str) -> str:
    """``{rollout_id}/{call_id}``: the key a staged delta is fetched by."""
    return f"{check_id(rollout, field='rollout_id')}/{check_id(call, field='call_id')}"


def shard_name(shard: int) -> str:
    _check_index(shard, "shard")
    return f"shard-{shard:05d}"


def attempt_name(attempt: int) -> str:
    _check_index(attempt, "attempt")
    return f"attempt-{attempt:02d}"


def _check_index(value: object, field: str) -> None:
    from tasks.checks import check_int  # here, not at the top: the DAG parse imports this module without numpy

    check_int(value, field=field, error=ValueError)


def derive_seed(batch_seed: int, *parts: int | str) -> int:
    """A deterministic 63-bit seed for a rollout or call, independent of batch shape and order."""
    material = ":".join(str(p) for p in (batch_seed, *parts)).encode("utf-8")
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "big") >> 1
