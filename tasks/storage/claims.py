"""Attempt claims: ``ledger/shard-K/attempt-NN/_CLAIM.json`` (ARCHITECTURE sections 2 and 10).

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
from dataclasses import asdict, dataclass

from tasks.ids import check_id
from tasks.storage import layout
from tasks.storage.objects import ObjectConflictError, ObjectStore

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
    """Create the claim of the first attempt of ``shard`` above every attempt used so far, and return it.

    Losing the create-once race for a number moves on to the next one; after
    :data:`MAX_CLAIM_RACES` lost races something is wrong and a RuntimeError says so.
    """
    check_id(batch_id, field="batch_id")
    attempt = max(attempts_used(store, shard), default=-1) + 1
    for _ in range(MAX_CLAIM_RACES):
        claim = AttemptClaim(
            batch_id=batch_id,
            shard=shard,
            attempt=attempt,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=time.time(),
            try_number=try_number,
            code_version=code_version,
        )
        try:
            if store.write_once(claim.path, claim.to_json().encode("utf-8")).created:
                return claim
        except ObjectConflictError:
            pass
        attempt += 1
    raise RuntimeError(f"lost {MAX_CLAIM_RACES} claim races for shard {shard} of {batch_id}: too many live writers")


def read_claims(store: ObjectStore, shard: int) -> list[AttemptClaim]:
    """The claims of ``shard``'s attempts, by attempt number; a claim that cannot be parsed is skipped."""
    claims = []
    for path in store.list_files(layout.ledger_shard_dir(shard)):
        if not path.endswith("/" + layout.CLAIM_NAME):
            continue
        try:
            claims.append(AttemptClaim(**json.loads(store.read_bytes(path))))
        except (ValueError, TypeError):
            continue
    return sorted(claims, key=lambda c: c.attempt)
