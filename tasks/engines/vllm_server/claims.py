"""What a vLLM server claims to serve, read from its own endpoints, and the checks a worker makes before its first call.

A server claims a model (``/v1/models``: its name, the folder it loaded, its context length), a
weight version (``/weight_info``; ``default`` until a refit names one, read as 0), whether it is
paused (``/is_paused``), a logprobs mode and its start identity (``/server_info``). All but the
first are among vLLM's RL/dev endpoints, on when the server runs with ``VLLM_SERVER_DEV_MODE=1``
(``rollout-ledger serve`` sets it). How the served weights are known to be the planned model's
(verified or declared) is judged in :mod:`tasks.engines.vllm_server.weights`, which this module uses
and which never uses it: a claim is a :class:`~tasks.engines.vllm_server.server_claim.ServerClaim`,
the value both read, kept below both.

Replicas caught mid-refit (one paused, or versions that differ: a rolling refit goes one replica
at a time) are read again until they agree, at most :data:`MID_REFIT_WAIT_SECONDS`, with a log
line at each read; past that, :class:`ReplicasMidRefitError` (retryable) ends the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from tasks.engines.vllm_server.options import VllmServerOptions
from tasks.engines.vllm_server.replica import SERVER_INFO_PATH, ServerAnswerError, ServerReplica, start_identity
from tasks.engines.vllm_server.server_claim import ServerClaim
from tasks.engines.vllm_server.weights import read_records, served_weights
from tasks.errors import ConfigError, EngineError

log = logging.getLogger(__name__)
REQUIRED_LOGPROBS_MODE = "processed_logprobs"
UNSET_WEIGHT_VERSION = "default"  # what vLLM reports before a version is set: the weights it started with
# How long a start waits for replicas caught mid-refit to agree (a rolling refit of several), and between reads.
MID_REFIT_WAIT_SECONDS = 1800.0
MID_REFIT_POLL_SECONDS = 5.0


class ReplicasMidRefitError(EngineError):
    """Replicas stayed mid-refit (paused, or at different weight versions) for the whole wait; a retry may pass."""

    reason = "replicas_mid_refit"


class ReplicaVersionsDifferError(ConfigError):
    """Replicas serve different weight versions (a refit refuses them; a start waits for them to agree)."""


def replicas_of(options: VllmServerOptions) -> list[ServerReplica]:
    """A client of each server ``options`` names, with its API key (close each when done)."""
    api_key, source = options.api_key(), options.key_source()
    return [
        ServerReplica(url, api_key=api_key, key_source=source, timeout_s=options.request_timeout_s)
        for url in options.urls
    ]


async def read_claims(
    replicas: list[ServerReplica],
    *,
    wait_s: float = MID_REFIT_WAIT_SECONDS,
    poll_s: float = MID_REFIT_POLL_SECONDS,
) -> list[ServerClaim]:
    """Each replica's claim (in order), once they agree (:func:`check_claims` passes on them).

    A refusal of :func:`check_claims` other than differing versions is raised at once. Replicas
    mid-refit (one paused, or versions that differ) are read again every ``poll_s`` seconds, with
    a log line each time, for at most ``wait_s``; then :class:`ReplicasMidRefitError`.
    """
    started = time.monotonic()
    while True:
        claims = [await read_claim(replica) for replica in replicas]
        with contextlib.suppress(ReplicaVersionsDifferError):  # mid-refit: read them again
            check_claims(claims)
            if not any(claim.paused for claim in claims):
                return claims
        waited = time.monotonic() - started
        state = ", ".join(f"{c.url} version {c.weight_version}{' (paused)' if c.paused else ''}" for c in claims)
        if waited >= wait_s:
            raise ReplicasMidRefitError(
                f"the servers stayed mid-refit for {waited:.0f} s ({state}); run again once the refit has ended"
            )
        log.info("the servers are mid-refit (%s): reading them again, %.0f s of at most %.0f s", state, waited, wait_s)
        await asyncio.sleep(poll_s)


def planned_weights(options: VllmServerOptions, model_folder: Path) -> str:
    """At plan time: how the servers' weights are known to be the planned model's (:func:`~.weights.served_weights`).

    Refuses, before anything is written, what a worker would refuse before its first call: a
    server that cannot be reached or refuses the key, replicas that disagree, another model (the
    weights of the version they serve now, hashed where they were loaded, must be the planned model's).
    """

    async def judge() -> str:
        replicas = replicas_of(options)
        try:
            claims = await read_claims(replicas)
            records = list(await asyncio.gather(*(read_records(replica) for replica in replicas)))
        finally:
            await asyncio.gather(*(replica.close() for replica in replicas))
        return await asyncio.to_thread(served_weights, claims, records, model_folder, options.served_model)

    return asyncio.run(judge())


async def read_claim(replica: ServerReplica) -> ServerClaim:
    """Ask ``replica`` what it serves; a :class:`ConfigError` when it cannot serve a batch at all."""
    models = await replica.get("/v1/models")
    entries = models.get("data") if isinstance(models, dict) else None
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict):
        raise ConfigError(f"server {replica.url} lists {models!r} at /v1/models; the engine needs exactly one model")
    entry = entries[0]
    try:
        info = await replica.get(SERVER_INFO_PATH, config_format="json")
        version = await replica.get("/weight_info")
        paused = await replica.get("/is_paused")
    except ServerAnswerError as exc:
        if exc.status != 404:
            raise
        raise ConfigError(
            f"server {replica.url} has no RL endpoints ({exc}); start it with VLLM_SERVER_DEV_MODE=1 "
            "(rollout-ledger serve does)"
        ) from None
    return ServerClaim(
        url=replica.url,
        model=str(entry.get("id")),
        root=str(entry.get("root") or entry.get("id")),
        max_model_len=_positive_int(entry.get("max_model_len"), f"server {replica.url}: max_model_len"),
        weight_version=parse_weight_version(_field(version, "weight_version"), replica.url),
        logprobs_mode=str(_field(_field(_field(info, "vllm_config"), "model_config"), "logprobs_mode")),
        paused=_field(paused, "is_paused") is True,
        identity=start_identity(info, replica.url),
    )


def parse_weight_version(value: Any, url: str) -> int:
    """A server's weight version as this project counts them: ``default`` is 0, else a non-negative int."""
    if value == UNSET_WEIGHT_VERSION:
        return 0
    try:
        version = int(value)
    except (TypeError, ValueError):
        version = -1
    if version < 0 or str(version) != str(value):
        raise EngineError(f"server {url} reports weight version {value!r}; this project needs an int >= 0")
    return version


def check_claims(claims: list[ServerClaim]) -> ServerClaim:
    """The one claim every replica makes; a :class:`ConfigError` naming the replica that differs
    (:class:`ReplicaVersionsDifferError` when only their weight versions differ)."""
    first = claims[0]
    for claim in claims:
        if claim.logprobs_mode != REQUIRED_LOGPROBS_MODE:
            raise ConfigError(
                f"server {claim.url} returns {claim.logprobs_mode} logprobs; captured logprobs must be "
                f"{REQUIRED_LOGPROBS_MODE} (start it with --logprobs-mode {REQUIRED_LOGPROBS_MODE})"
            )
        if not claim.same_model(first):
            raise ConfigError(
                f"replicas differ: {first.url} serves {first.model} ({first.root}, {first.max_model_len} tokens), "
                f"{claim.url} serves {claim.model} ({claim.root}, {claim.max_model_len} tokens)"
            )
    for claim in claims:
        if claim.weight_version != first.weight_version:
            raise ReplicaVersionsDifferError(
                f"replicas serve different weight versions: {first.url} {first.weight_version}, "
                f"{claim.url} {claim.weight_version}; refit them together (rollout-ledger refit)"
            )
    return first


def _field(mapping: Any, name: str) -> Any:
    if not isinstance(mapping, dict) or name not in mapping:
        raise EngineError(f"a server answer lacks {name!r}: {str(mapping)[:200]}")
    return mapping[name]


def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise EngineError(f"{what} is {value!r}, not an int >= 2")
    return value
