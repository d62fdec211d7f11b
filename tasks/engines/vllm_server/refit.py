"""A refit of running vLLM servers through their own RL endpoints (``VLLM_SERVER_DEV_MODE=1``).

On each replica in turn: ``/pause?mode=keep`` freezes the running requests in place,
``/collective_rpc reload_weights`` loads the folder into the workers, ``/update_weight_version``
names the new version, ``/reset_prefix_cache`` drops KV blocks computed under the old weights, and
``/resume`` always follows. Requests admitted before the switch keep running; the spans the
server returns with each answer say which tokens which version sampled.
"""

from __future__ import annotations

import contextlib

from tasks.engines.base import next_weight_version
from tasks.engines.vllm_server.claims import check_claims, read_claim
from tasks.engines.vllm_server.options import REFIT_TIMEOUT_SECONDS
from tasks.engines.vllm_server.replica import ServerReplica
from tasks.errors import ConfigError, EngineError


async def refit_replica(replica: ServerReplica, folder: str, version: int) -> None:
    """Load ``folder`` (a path on the server's machine) into ``replica`` as weight version ``version``."""
    await replica.post("/pause", mode="keep")
    resumed = False
    try:
        await replica.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        await replica.post("/update_weight_version", {"new_version": str(version)})
        await replica.post("/reset_prefix_cache", reset_running_requests="true")
        await replica.post("/resume")
        resumed = True
    finally:
        if not resumed:
            with contextlib.suppress(EngineError):
                await replica.post("/resume")


async def refit_servers(replicas: list[ServerReplica], folder: str, version: int) -> None:
    """Refit every replica to ``folder`` at ``version``; an :class:`EngineError` names the replica that failed."""
    for replica in replicas:
        try:
            await refit_replica(replica, folder, version)
        except EngineError as exc:
            raise type(exc)(f"refit of {replica.url} to {folder} (version {version}) failed: {exc}") from exc


async def refit_urls(urls: list[str], folder: str, version: int | None, *, api_key: str | None, key_source: str) -> int:
    """Refit the servers at ``urls`` (replicas of one model) to ``folder``; return the new weight version.

    ``version`` must exceed the version they serve now (``None``: one more). The library call
    behind ``rollout-ledger refit``.
    """
    replicas = [
        ServerReplica(url, api_key=api_key, key_source=key_source, timeout_s=REFIT_TIMEOUT_SECONDS) for url in urls
    ]
    try:
        claim = check_claims([await read_claim(replica) for replica in replicas])
        if version is not None and version <= claim.weight_version:
            raise ConfigError(f"weight version {version} is not above the {claim.weight_version} the servers serve now")
        new_version = next_weight_version(claim.weight_version, version)
        await refit_servers(replicas, folder, new_version)
        return new_version
    finally:
        for replica in replicas:
            await replica.close()
