"""A refit of running vLLM servers through their own RL endpoints (``VLLM_SERVER_DEV_MODE=1``), failing closed.

The folder is hashed here first, where it is readable (else its weights are declared, not
verified). Then, on each replica in turn: ``/pause?mode=keep`` freezes the running requests in
place, ``POST /rollout-ledger/weights/next`` announces the weights the load brings (the server's
weight records, :mod:`tasks.engines.weight_records`; a server without them skips it),
``/collective_rpc reload_weights`` loads the folder into the workers (a server of ``serve`` answers
once it has hashed the folder it loaded itself), the server's record of that load is read back,
``/update_weight_version`` names the new version, ``/reset_prefix_cache`` drops KV blocks computed
under the old weights, and ``/resume`` lets requests run again. Requests admitted before the switch
keep running; the spans the server returns with each answer say which tokens which version sampled.

Verified or declared: a server's record of the load is verified only when the server's own hash of
the folder it loaded is the one announced here (:attr:`~tasks.engines.weight_records.Load.verified_sha256`);
else the new version's weights are declared, not verified, and :meth:`Refit.verdicts` says why (the
refit itself succeeds: the server serves what it loaded, under its true label).

Fail closed: when a step fails, the replica is left paused (no request runs on weights that may
be half loaded, or under the old version's name) and :class:`RefitFailedError` names the replica,
its state and the way out: refit again to a folder that loads, or restart the server. Replicas
before it serve the new version; those after it are untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from tasks.engines.base import next_weight_version
from tasks.engines.vllm_server.claims import ReplicaVersionsDifferError, check_claims, read_claim
from tasks.engines.vllm_server.options import REFIT_TIMEOUT_SECONDS
from tasks.engines.vllm_server.replica import ServerAnswerError, ServerReplica
from tasks.engines.vllm_server.weights import read_records
from tasks.engines.weight_records import ANNOUNCE_PATH, LOADED_BY_REFIT, Announcement, Load
from tasks.errors import ConfigError, EngineDeadError, EngineError
from tasks.models.provenance import hashed_weights


class RefitFailedError(EngineDeadError):
    """A refit step failed on a replica, which is left paused (fail closed); the message says how to recover."""

    reason = "refit_failed"


@dataclass(frozen=True)
class Refit:
    """A refit: the folder (a path on the servers' machine), the new weight version, the weights announced (hashed
    where the refit ran) and, by URL, the load each server recorded (``None``: a server without weight records)."""

    folder: str
    version: int
    announced: Announcement
    recorded: dict[str, Load | None]

    def verdicts(self) -> list[str]:
        """Each server's record of the load, in words: verified, or declared and why."""
        return [f"{url}: {_verdict(load, self.announced)}" for url, load in self.recorded.items()]


RECORD_STEP = "read the load's record"


async def refit_replica(replica: ServerReplica, folder: str, version: int, announced: Announcement) -> Load | None:
    """Load ``folder`` into ``replica`` as ``version``, announced as ``announced``; the load the server recorded
    (``None``: a server without weight records). A :class:`RefitFailedError` leaves the replica paused."""
    steps = (
        ("pause", lambda: replica.post("/pause", mode="keep")),
        ("announce the weights", lambda: _announce(replica, announced)),
        ("reload_weights", lambda: replica.post("/collective_rpc", _reload(folder))),
        (RECORD_STEP, lambda: read_records(replica, since=version)),
        ("update_weight_version", lambda: replica.post("/update_weight_version", {"new_version": str(version)})),
        ("reset_prefix_cache", lambda: replica.post("/reset_prefix_cache", reset_running_requests="true")),
        ("resume", lambda: replica.post("/resume")),
    )
    answers: dict[str, Any] = {}
    for step, call in steps:
        try:
            answers[step] = await call()
        except EngineError as exc:
            state = await replica_state(replica)
            raise RefitFailedError(
                f"refit of {replica.url} to {folder} (version {version}) failed at {step}: {exc}; the "
                f"replica is {state}. Recover: run rollout-ledger refit again with a folder that loads (its version "
                "must exceed the one the replica reports), or restart the server (it then serves its start-up "
                "weights at version 0)"
            ) from exc
    records = answers[RECORD_STEP]
    return None if records is None else records.serving


async def replica_state(replica: ServerReplica) -> str:
    """The state of a replica a refit step failed on, in words (``/is_paused``; asked twice: a server may close
    the connection its failed answer came over)."""
    for attempt in range(2):
        try:
            answer = await replica.get("/is_paused")
            break
        except EngineError as exc:
            if attempt == 1 or not isinstance(exc, EngineDeadError):
                return f"in an unknown state (/is_paused: {exc})"
    if isinstance(answer, dict) and answer.get("is_paused") is True:
        return "paused: it serves no request until a refit succeeds"
    if isinstance(answer, dict) and answer.get("is_paused") is False:
        return "not paused: it serves the weights it had before"
    return f"in an unknown state (/is_paused answered {str(answer)[:200]})"


async def refit_servers(replicas: list[ServerReplica], folder: str, version: int) -> Refit:
    """Refit every replica in turn to ``folder`` at ``version`` (hashed here first); a :class:`RefitFailedError`
    names the replica that failed, and which replicas were refit before it."""
    announced = Announcement(await asyncio.to_thread(hashed_weights, folder), str(folder))
    recorded: dict[str, Load | None] = {}
    for index, replica in enumerate(replicas):
        try:
            recorded[replica.url] = await refit_replica(replica, announced.folder, version, announced)
        except RefitFailedError as exc:
            if len(replicas) == 1:
                raise
            done = [r.url for r in replicas[:index]]
            untouched = [r.url for r in replicas[index + 1 :]]
            raise RefitFailedError(
                f"{exc}. Refit before it (serving version {version}): {done or 'none'}; "
                f"not refit: {untouched or 'none'}"
            ) from exc
    return Refit(announced.folder, version, announced, recorded)


async def refit_urls(
    urls: list[str], folder: str, version: int | None, *, api_key: str | None, key_source: str
) -> Refit:
    """Refit the servers at ``urls`` (replicas of one model) to ``folder``; what was loaded, at which version.

    ``version`` must exceed every version they serve now (``None``: one more than the highest);
    replicas left at different versions by a refit that failed part-way are brought together.
    The library call behind ``rollout-ledger refit``.
    """
    replicas = [
        ServerReplica(url, api_key=api_key, key_source=key_source, timeout_s=REFIT_TIMEOUT_SECONDS) for url in urls
    ]
    try:
        claims = [await read_claim(replica) for replica in replicas]
        with contextlib.suppress(ReplicaVersionsDifferError):  # a refit that failed part-way: this one mends it
            check_claims(claims)
        current = max(claim.weight_version for claim in claims)
        if version is not None and version <= current:
            raise ConfigError(f"weight version {version} is not above the {current} the servers serve now")
        return await refit_servers(replicas, folder, next_weight_version(current, version))
    finally:
        for replica in replicas:
            await replica.close()


async def _announce(replica: ServerReplica, announced: Announcement) -> None:
    """Tell the server which weights its next load brings; a server without weight records has no such route."""
    try:
        await replica.post(ANNOUNCE_PATH, announced.to_json())
    except ServerAnswerError as exc:
        if exc.status != 404:
            raise


def _reload(folder: str) -> dict[str, object]:
    return {"method": "reload_weights", "kwargs": {"weights_path": folder}}


def _verdict(load: Load | None, announced: Announcement) -> str:
    """What a server's record of a refit's load says of its weights, in words."""
    declared = "declared, not verified"
    if load is None:
        return f"{declared}: it keeps no weight records (it was not started by rollout-ledger serve)"
    if load.verified_sha256 is not None:
        return "verified: the server hashed the folder it loaded to the sha256 hashed here"
    if load.loaded_by != LOADED_BY_REFIT or load.announced != announced:
        return f"{declared}: the weights in place are not this refit's load (the server recorded: {load.loaded_by})"
    if load.folder != announced.folder:
        return f"{declared}: the server loaded {load.folder or 'a folder it cannot name'}, not {announced.folder}"
    if announced.weights_sha256 is None:
        return f"{declared}: the folder was not hashed here"
    if load.weights_sha256 is None:
        return f"{declared}: the server could not hash {load.folder} where it runs"
    return (
        f"{declared}: the server hashed the folder it loaded to sha256 {load.weights_sha256}, not the one hashed "
        "here (another copy at that path on the server's machine, or a folder changed after it was hashed here)"
    )
