"""What the ledger keeps of a call (docs/architecture.md §5, steps 5-7): its staged delta and call record,
or its failure row.

:meth:`CallRecorder.record` stages the delta (group commit) and, only once its segment is durable,
hands the call record to the ledger: the durability boundary (a child is admitted only after its
parent's record exists). A delta the records refuse is ``invalid_delta``; a failed write is
``staging_failed`` or ``ledger_failed``. Storage unavailable through every retry
(:class:`StorageUnavailableError`) is no failure of the call: it propagates and ends the attempt.
The recorder keeps the coordinates of what this attempt staged (the prefix cache's fetch input)
until the rollout is released.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tasks import ids
from tasks.capture.admission import Admitted, AdmittedVersion
from tasks.capture.faults import INVALID_DELTA, LEDGER_FAILED, STAGING_FAILED, CallFault
from tasks.capture.rollout import RolloutCapture
from tasks.capture.terminal import fingerprint_content
from tasks.engines.base import Engine, GenerationResult
from tasks.errors import StorageUnavailableError
from tasks.records.ledger import CallRecord, FailureRow, StagedDelta
from tasks.records.sampling_mask import KEPT_NOTE, KeptSets
from tasks.sampling import SamplingSettings
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.staging import CommitCoordinates, StagingWriter

MAX_FAILURE_DETAIL = 2000  # characters of a failure's detail kept in its row


# Keys of the envelope staged extras take when the capture adds notes of its own: the gateway's
# message-graph notes, a resumed episode's (tasks.capture.replay) and the digest of a truncated call's kept sets
# (tasks.records.sampling_mask); the engine's extras then go under "engine".
NOTE_KEYS = ("gateway", "resume", KEPT_NOTE)


def staged_extras(
    engine_extras: Any,
    gateway: Mapping[str, Any],
    resume: Mapping[str, Any] | None = None,
    kept: KeptSets | None = None,
) -> Any:
    """The staged extras: the engine's alone, or in an envelope with the capture's notes
    (``{"gateway": ..., "resume": ..., "sampling": ..., "engine": ...}``, each present only when it has something)."""
    values = (gateway, resume or {}, kept.note() if kept is not None else {})
    notes = {key: dict(value) for key, value in zip(NOTE_KEYS, values, strict=True) if value}
    if not notes:
        return engine_extras
    if engine_extras is not None:
        notes["engine"] = engine_extras
    return notes


def engine_extras(extras: Any) -> Any:
    """The engine's own part of staged ``extras`` (:func:`staged_extras`' inverse)."""
    if isinstance(extras, dict) and any(key in extras for key in NOTE_KEYS):
        return extras.get("engine")
    return extras


def failure_row(rollout: RolloutCapture, call: Admitted, fault: CallFault) -> FailureRow:
    """The failure row of ``call``: its parent and the fault's reason and (bounded) detail."""
    return FailureRow(
        batch_id=rollout.batch_id,
        rollout_id=rollout.rollout_id,
        call_id=call.call_id,
        parent_call_id=call.parent_call_id,
        reason=fault.reason,
        detail=fault.detail[:MAX_FAILURE_DETAIL],
    )


class CallRecorder:
    """The staging and ledger writes of one shard attempt's captured calls."""

    def __init__(
        self, engine: Engine, sampling: SamplingSettings, staging: StagingWriter, ledger: LedgerWriter
    ) -> None:
        self._engine = engine
        self._sampling = sampling
        self._staging = staging
        self._ledger = ledger
        self._coordinates: dict[str, CommitCoordinates] = {}

    def coordinates_of(self, keys: Sequence[str]) -> list[tuple[str, CommitCoordinates]]:
        """(staging key, coordinates) of calls this attempt staged: the prefix cache's fetch input."""
        return [(key, self._coordinates[key]) for key in keys]

    def carry(self, record: CallRecord) -> None:
        """Read a replayed call of an earlier attempt from where that attempt staged it (the prefix cache's input)."""
        key = ids.staging_key(record.rollout_id, record.call_id)
        self._coordinates[key] = CommitCoordinates(segment=record.staging_segment, row=record.staging_row)

    def forget(self, records: Sequence[CallRecord]) -> None:
        """Drop the coordinates of a finished rollout's calls: memory stays bounded by the rollouts in flight."""
        for record in records:
            self._coordinates.pop(ids.staging_key(record.rollout_id, record.call_id), None)

    async def add_failure(self, failure: FailureRow) -> None:
        """Hand a failure row to the ledger."""
        await asyncio.to_thread(self._ledger.add_failure, failure)

    async def record(
        self,
        rollout: RolloutCapture,
        call: Admitted,
        parent_tokens: np.ndarray,
        prompt: np.ndarray,
        completion: GenerationResult,
        admitted: AdmittedVersion,
        extras: Any,
    ) -> CallRecord:
        """Stage ``call``'s delta, then hand its record to the ledger once the delta is durable; the record."""
        call_id = call.call_id
        try:
            delta = StagedDelta.build(
                batch_id=rollout.batch_id,
                rollout_id=rollout.rollout_id,
                call_id=call_id,
                parent_call_id=call.parent_call_id,
                parent_chain_hash=call.parent.chain_hash if call.parent else None,
                prefix_token_ids=parent_tokens,
                prompt_token_ids=prompt,
                generated_token_ids=list(completion.token_ids),
                generated_logprobs=completion.logprobs,
                weight_version=admitted.weight_version,
                finish_reason=completion.finish_reason,
                temperature=self._sampling.temperature,
                top_p=self._sampling.top_p,
                top_k=self._sampling.top_k,
                extras=extras,
                logprobs_mode=self._sampling.logprobs_mode,
                kept=completion.kept,
            )
        except (TypeError, ValueError) as exc:
            raise CallFault(INVALID_DELTA, f"delta of {call_id} is invalid: {exc}", completion) from None
        fingerprint = fingerprint_content(completion.text)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[CallRecord | Exception] = loop.create_future()

        def settle(result: CallRecord | Exception) -> None:
            if not done.done():
                done.set_result(result)

        def record_when_staged(staged: concurrent.futures.Future[CommitCoordinates]) -> None:
            # Runs where the staging future resolves (the writer thread, after the group commit):
            # the ledger gets the record there, and the call comes back to the loop once, not twice.
            try:
                coordinates = staged.result()
            except StorageUnavailableError as exc:
                result: CallRecord | Exception = exc
            except BaseException as exc:
                result = CallFault(STAGING_FAILED, f"staging {call_id} failed: {exc!r}", completion)
            else:
                self._coordinates[delta.staging_key] = coordinates
                try:
                    record = CallRecord.for_staged(
                        delta,
                        staging_segment=coordinates.segment,
                        staging_row=coordinates.row,
                        admitted_at=admitted.at,
                        epoch_span=admitted.spanned(self._engine),
                        output_fingerprint=fingerprint,
                        response_id=completion.response_id,
                    )
                    self._ledger.add_call(record)
                    result = record
                except StorageUnavailableError as exc:
                    result = exc
                except Exception as exc:
                    result = CallFault(LEDGER_FAILED, f"ledger record of {call_id} failed: {exc!r}", completion)
            loop.call_soon_threadsafe(settle, result)

        try:
            # The callback is attached before the delta is buffered: the record is added before the
            # staging writer's after-commit hook flushes the ledger.
            self._staging.submit(delta, done_callback=record_when_staged)
        except Exception as exc:
            raise CallFault(STAGING_FAILED, f"staging {call_id} failed: {exc!r}", completion) from None
        result = await done
        if isinstance(result, Exception):
            raise result
        return result
