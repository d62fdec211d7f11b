"""A refit of running vLLM servers through their own RL endpoints (``VLLM_SERVER_DEV_MODE=1``), failing closed.

The folder is hashed here first, where it is readable (else its weights are declared, not
verified). Then, on each replica in turn: ``/pause?mode=keep`` freezes the running requests in
place, ``POST /rollout-ledger/weights/next`` announces the weights the load brings (the server's
weight records, :mod:`tasks.engines.weight_records`; a server without them skips it),
``/collective_rpc reload_weights`` loads the folder into the workers, ``/update_weight_version``
names the new version, ``/reset_prefix_cache`` drops KV blocks computed under the old weights,
and ``/resume`` lets requests run again. Requests admitted before the switch keep running; the
spans the server returns with each answer say which tokens which version sampled.

Fail closed: when a step fails, the replica is left paused (no request runs on weights that may
be half loaded, or under the old version's name) and :class:`RefitFailedError` names the replica,
its state and the way out: refit again to a folder that loads, or restart the server. Replicas
before it serve the new version; those after it are untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from tasks.engines.base import next_weight_version
from tasks.engines.vllm_server.claims import ReplicaVersionsDifferError, check_claims, read_claim
from tasks.engines.vllm_server.options import REFIT_TIMEOUT_SECONDS
from tasks.engines.vllm_server.replica import ServerAnswerError, ServerReplica
from tasks.engines.weight_records import ANNOUNCE_PATH, LOADED_BY_REFIT, Load
from tasks.errors import ConfigError, EngineDeadError, EngineError
from tasks.models.provenance import hashed_weights


class RefitFailedError(EngineDeadError):
    """A refit step failed on a replica, which is left paused (fail closed); the message says how to recover."""

    reason = "refit_failed"


@dataclass(frozen=True)
class Refit:
    """A refit: the folder (a path on the servers' machine), the new weight version, and what the load brings."""

    folder: str
    version: int
    load: Load


async def refit_replica(replica: ServerReplica, refit: Refit) -> None:
    """Load ``refit.folder`` into ``replica`` as ``refit.version``; a :class:`RefitFailedError` leaves it paused."""
    steps = (
        ("pause", lambda: replica.post("/pause", mode="keep")),
        ("announce the weights", lambda: _announce(replica, refit.load)),
        ("reload_weights", lambda: replica.post("/collective_rpc", _reload(refit.folder))),
        ("update_weight_version", lambda: replica.post("/update_weight_version", {"new_version": str(refit.version)})),
        ("reset_prefix_cache", lambda: replica.post("/reset_prefix_cache", reset_running_requests="true")),
        ("resume", lambda: replica.post("/resume")),
    )
    for step, call in steps:
        try:
            await call()
        except EngineError as exc:
            state = await replica_state(replica)
            raise RefitFailedError(
                f"refit of {replica.url} to {refit.folder} (version {refit.version}) failed at {step}: {exc}; the "
                f"replica is {state}. Recover: run rollout-ledger refit again with a folder that loads (its version "
                "must exceed the one the replica reports), or restart the server (it then serves its start-up "
                "weights at version 0)"
            ) from exc


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
    refit = Refit(folder, version, Load(LOADED_BY_REFIT, await asyncio.to_thread(hashed_weights, folder), folder))
    for index, replica in enumerate(replicas):
        try:
            await refit_replica(replica, refit)
        except RefitFailedError as exc:
            if len(replicas) == 1:
                raise
            done = [r.url for r in replicas[:index]]
            untouched = [r.url for r in replicas[index + 1 :]]
            raise RefitFailedError(
                f"{exc}. Refit before it (serving version {version}): {done or 'none'}; "
                f"not refit: {untouched or 'none'}"
            ) from exc
    return refit


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


async def _announce(replica: ServerReplica, load: Load) -> None:
    """Tell the server which weights its next load brings; a server without weight records has no such route."""
    try:
        await replica.post(ANNOUNCE_PATH, {"weights_sha256": load.weights_sha256, "folder": load.folder})
    except ServerAnswerError as exc:
        if exc.status != 404:
            raise


def _reload(folder: str) -> dict[str, object]:
    return {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
