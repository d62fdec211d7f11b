"""Claims: ``ledger/shard-K/attempt-NN/_CLAIM.json`` and the create-once claim of the next free number.

An attempt of a shard starts by creating its claim, create-once, before it writes anything
else. A writer that loses the race for a number (another process created that claim first)
takes the next one, so two live writers of one shard (a zombie task and its retry) never share
an attempt directory. A claim records who ran the attempt, for ``rollout-ledger status`` and
post-mortems; it is never deleted by the sweep.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tasks import layout
from tasks.checks import check_finite, check_int
from tasks.errors import MalformedClaimError, ObjectConflictError
from tasks.ids import check_id
from tasks.storage.objects import ObjectStore
from tasks.strict_json import load_dataclass, parse_json

MAX_CLAIM_RACES = 64


@dataclass(frozen=True)
class AttemptClaim:
    """Who runs (or ran) an attempt: host, process id, start time, orchestrator try number, code version."""

    batch_id: str
    shard: int
    attempt: int
    host: str
    pid: int
    started_at: float
    try_number: int | None
    code_version: str

    def __post_init__(self) -> None:
        check_id(self.batch_id, field="batch_id")
        for name in ("shard", "attempt", "pid"):
            check_int(getattr(self, name), field=name)
        check_finite(self.started_at, field="started_at")
        if self.try_number is not None:
            check_int(self.try_number, field="try_number")
        for name in ("host", "code_version"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {getattr(self, name)!r}")

    @property
    def path(self) -> str:
        return layout.attempt_claim(self.shard, self.attempt)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def attempts_used(store: ObjectStore, shard: int) -> set[int]:
    """Every attempt of ``shard`` that left an object (claim, staging or ledger); ``store`` is the batch's."""
    used = set()
    for directory in (layout.staging_shard_dir(shard), layout.ledger_shard_dir(shard)):
        for path in store.list_files(directory):
            try:
                used.add(layout.attempt_of(path))
            except ValueError:  # the shard marker lives outside attempt directories
                continue
    return used


def claim_attempt(
    store: ObjectStore, *, batch_id: str, shard: int, try_number: int | None = None, code_version: str = ""
) -> AttemptClaim:
    """Create the claim of the first attempt of ``shard`` above every attempt used so far, and return it."""
    check_id(batch_id, field="batch_id")
    claims: dict[int, AttemptClaim] = {}

    def claim(attempt: int) -> tuple[str, bytes]:
        claims[attempt] = AttemptClaim(
            batch_id=batch_id,
            shard=shard,
            attempt=attempt,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=time.time(),
            try_number=try_number,
            code_version=code_version,
        )
        return claims[attempt].path, claims[attempt].to_json().encode("utf-8")

    first = max(attempts_used(store, shard), default=-1) + 1
    return claims[claim_next(store, first, claim, what=f"shard {shard} of {batch_id}")]


def claim_next(store: ObjectStore, first: int, claim: Callable[[int], tuple[str, bytes]], *, what: str) -> int:
    """Create, create-once, the claim of number ``first`` or the next free one above it, and return that number.

    ``claim(number)`` gives the claim object's path and bytes; the bytes must be this writer's own
    (host, pid, start time), so an identical object already there is this writer's too: a write
    that reached storage but whose answer was lost, and that the storage retry repeated. Losing
    the race for a number (another writer's claim is there) moves on to the next one, so two live
    writers never share a number. After :data:`MAX_CLAIM_RACES` lost races a RuntimeError says so.
    """
    for number in range(first, first + MAX_CLAIM_RACES):
        path, data = claim(number)
        try:
            store.write_once(path, data)
        except ObjectConflictError:
            continue
        return number
    raise RuntimeError(f"lost {MAX_CLAIM_RACES} claim races for {what}: too many live writers")


def read_claims(store: ObjectStore, shard: int) -> list[AttemptClaim]:
    """The claims of ``shard``'s attempts, by attempt number.

    A claim that does not parse, or that names another batch, shard or attempt than its path,
    raises :class:`MalformedClaimError` naming the path and the problem.
    """
    paths = [p for p in store.list_files(layout.ledger_shard_dir(shard)) if is_claim_path(p, shard)]
    return sorted((_read_claim(store, path, shard) for path in paths), key=lambda c: c.attempt)


def is_claim_path(path: str, shard: int) -> bool:
    """Whether ``path`` is the claim of one of the shard's attempts, exactly where the layout puts it."""
    try:
        return path == layout.attempt_claim(shard, layout.attempt_of(path))
    except ValueError:
        return False


def _read_claim(store: ObjectStore, path: str, shard: int) -> AttemptClaim:
    source = f"{store.url}/{path}"
    raw = parse_json(store.read_bytes(path), source=source, error=MalformedClaimError)
    claim = load_dataclass(AttemptClaim, raw, source=source, error=MalformedClaimError, require_all=True)
    if claim.path != path:
        raise MalformedClaimError(f"{source} claims shard {claim.shard} attempt {claim.attempt}: not its own path")
    return claim
