"""Which weights the servers serve, judged before the first call, and which weights sampled each call.

Before the first call (plan and generate), :func:`served_weights` judges the weights of the
version the servers serve: *verified* when they were hashed where they were loaded (the server's
weight records, :mod:`tasks.engines.weight_records`, verify every load of that version, all to one
sha256: the server hashed what it loaded, and for a refit its hash is the announced one; a server
without records, at its start-up version, loaded a folder on this machine), else *declared*,
accepted only by the server's model name (``served_model``).

After each answer, :meth:`ServedWeights.stamp` reads the answering replica's records and names,
for every version in the call's weight spans, the sha256 of that version's weights, or ``None``
where they are not verified, in the call's extras (:func:`tasks.models.provenance.weights_extras`:
covered by the call's digest, read by finalize). The read starts after the answer arrived, so it
holds every load that could have sampled the answer's tokens; a load recorded later only turns a
version from verified to declared. Answers that arrive together share one read. A server without
records (not started by ``rollout-ledger serve``) gets no such extras: finalize takes the plan's
check for the planned version and declares every other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from pathlib import Path

from tasks.engines.base import GenerationResult
from tasks.engines.vllm_server.replica import ReplicaDeadError, ServerAnswerError, ServerReplica
from tasks.engines.vllm_server.server_claim import ServerClaim
from tasks.engines.weight_records import RECORDS_PATH, Load, RecordsFormatError, WeightRecords
from tasks.errors import EngineError, ModelMismatchError
from tasks.models.provenance import (
    WEIGHTS_DECLARED,
    WEIGHTS_VERIFIED,
    hashed_weights,
    model_provenance,
    tokenizer_provenance,
    weights_extras,
)


async def read_records(replica: ServerReplica, *, since: int = 0) -> WeightRecords | None:
    """The weight records of ``replica`` (versions ``since`` and above); ``None`` for a server that keeps none."""
    try:
        answer = await replica.get(RECORDS_PATH, since=since)
    except ServerAnswerError as exc:
        if exc.status == 404:  # a vLLM server not started by rollout-ledger serve
            return None
        raise
    try:
        return WeightRecords.from_json(answer)
    except RecordsFormatError as exc:
        raise EngineError(f"server {replica.url}: weight records: {exc}") from None


def served_weights(
    claims: list[ServerClaim],
    records: list[WeightRecords | None],
    planned_folder: Path,
    served_model: str | None,
    *,
    at_planned_version: bool = True,
) -> str:
    """:func:`check_served_weights` of every replica (its claim, its records); verified only when all are."""
    pairs = list(zip(claims, records, strict=True))
    hashed = any(kept is not None and kept.sha256_of(claim.weight_version) for claim, kept in pairs)
    planned_sha = hashed_weights(planned_folder) if at_planned_version and hashed else None
    verdicts = {check_served_weights(claim, planned_folder, served_model, kept, planned_sha) for claim, kept in pairs}
    return WEIGHTS_VERIFIED if verdicts == {WEIGHTS_VERIFIED} else WEIGHTS_DECLARED


def check_served_weights(
    claim: ServerClaim,
    planned_folder: Path,
    served_model: str | None,
    records: WeightRecords | None = None,
    planned_sha: str | None = None,
) -> str:
    """:data:`WEIGHTS_VERIFIED` or :data:`WEIGHTS_DECLARED`; a :class:`ModelMismatchError` for another model.

    ``planned_folder`` is the planned model, already checked against the plan; a served folder on
    this machine must have its tokenizer and chat template. Verified: ``records`` hash every load of
    the version the server serves to one sha256, which must be ``planned_sha`` when given (the
    planned version's weights); without records (a server not started by ``rollout-ledger serve``),
    the server is at its start-up version and the folder it loaded is on this machine, whose weights
    must hash as the planned model's. Declared: weights nobody hashed, accepted only when the
    server's model name is ``served_model``.
    """
    served = Path(claim.root)
    same_folder = served.is_dir() and served.resolve() == planned_folder.resolve()
    at_start_up = records is None and claim.weight_version == 0
    if served.is_dir() and not same_folder:
        hashes = model_provenance if at_start_up else tokenizer_provenance
        planned = hashes(planned_folder)
        differ = [name for name, value in hashes(served).items() if value != planned[name]]
        if differ:
            raise ModelMismatchError(
                f"server {claim.url} serves {served}, whose {', '.join(differ)} differ from the planned "
                f"model's ({planned_folder})"
            )
    if at_start_up and served.is_dir():
        return WEIGHTS_VERIFIED  # the planned folder itself, or one that hashes as it
    sha = records.sha256_of(claim.weight_version) if records is not None else None
    if sha is not None and planned_sha is not None and sha != planned_sha:
        raise ModelMismatchError(
            f"server {claim.url} serves weight version {claim.weight_version} ({describe_loads(records, claim)}), "
            f"not the planned model's weights ({planned_folder}): plan with --model naming the folder it serves, "
            "or refit the servers to the planned model"
        )
    if sha is not None:
        return WEIGHTS_VERIFIED
    if records is not None:
        loads = describe_loads(records, claim)
        unhashed = f"weight version {claim.weight_version}, whose weights are not verified ({loads})"
    elif claim.weight_version == 0:
        unhashed = f"{claim.model!r} from {claim.root!r}, which is not on this machine to hash against the plan"
    else:
        unhashed = (
            f"weight version {claim.weight_version} and keeps no weight records (it was not started by rollout-ledger "
            "serve): nobody hashed the weights it loaded after its start"
        )
    if served_model is None:
        raise ModelMismatchError(
            f"server {claim.url} serves {unhashed}; set the engine option served_model={claim.model!r} to accept "
            "its weights as declared, not verified"
        )
    if claim.model != served_model:
        raise ModelMismatchError(
            f"server {claim.url} serves {claim.model!r}, not the declared served_model {served_model!r}"
        )
    return WEIGHTS_DECLARED


def describe_loads(records: WeightRecords | None, claim: ServerClaim) -> str:
    """The loads of the version ``claim`` names, in words (for messages)."""
    loads = records.versions.get(claim.weight_version, ()) if records is not None else ()
    if not loads:
        return "no load recorded for it"
    return "; ".join(_described(load) for load in loads)


def _described(load: Load) -> str:
    """One load in words: what it loaded, the server's hash, and for a refit whose hashes differ what it announced."""
    text = f"{load.loaded_by} of {load.folder or 'weights from elsewhere'}, {_hashed(load.weights_sha256)}"
    if load.announced is not None and load.verified_sha256 is None:
        text += f" (announced: {load.announced.folder}, {_hashed(load.announced.weights_sha256)})"
    return text


def _hashed(sha: str | None) -> str:
    return f"sha256 {sha[:12]}…" if sha else "not hashed"


class ServedWeights:
    """Names the weights of each version in a call's spans, from the answering replica's records.

    ``keeping`` are the URLs of the replicas that keep records; ``since`` the lowest version read.
    """

    def __init__(self, keeping: set[str], *, since: int) -> None:
        self._keeping = keeping
        self._since = since
        self._ticks = itertools.count()  # orders answers and record reads
        self._reads: dict[str, tuple[int, asyncio.Future[WeightRecords | None]]] = {}

    @classmethod
    async def connect(
        cls,
        replicas: list[ServerReplica],
        claims: list[ServerClaim],
        planned_folder: Path,
        served_model: str | None,
        *,
        planned_version: int,
    ) -> tuple[str, ServedWeights]:
        """The verdict on the weights the replicas serve (:func:`served_weights`), and the stamper of their calls.

        Their weights must be the planned model's when they serve the planned version (a later
        version is a refit's, named per call).
        """
        records = list(await asyncio.gather(*(read_records(replica) for replica in replicas)))
        version = claims[0].weight_version
        verdict = await asyncio.to_thread(
            served_weights,
            claims,
            records,
            planned_folder,
            served_model,
            at_planned_version=version <= planned_version,
        )
        keeping = {replica.url for replica, kept in zip(replicas, records, strict=True) if kept is not None}
        return verdict, cls(keeping, since=version)

    async def stamp(self, result: GenerationResult, replica: ServerReplica) -> GenerationResult:
        """``result`` with extras naming the weights of each version in its spans, as ``replica`` recorded them."""
        if replica.url not in self._keeping:
            return result
        records = await self._read_after(replica, next(self._ticks))
        by_version = {span.version: records.sha256_of(span.version) for span in result.weight_spans}
        return dataclasses.replace(result, extras=weights_extras(by_version))

    async def _read_after(self, replica: ServerReplica, answered: int) -> WeightRecords:
        """Records of ``replica`` from a read that started after the answer of tick ``answered``."""
        started, read = self._reads.get(replica.url, (-1, None))
        if read is None or started < answered:
            started = next(self._ticks)
            read = asyncio.ensure_future(read_records(replica, since=self._since))
            self._reads[replica.url] = (started, read)
        try:
            records = await asyncio.shield(read)
        except ReplicaDeadError as error:
            raise replica.lose(error) from None
        if records is None:
            raise replica.lose(
                ReplicaDeadError(replica.url, f"server {replica.url} no longer keeps weight records: it was replaced")
            )
        return records
