"""Hand-built chains verified through finalization's own path, from in-memory ledger tables.

:func:`build_chain` stages a linear chain with the real record builders; :func:`verify_rollouts`
lays the rollouts out as a committed shard would (ledger tables of attempt 0, one staging
segment in an in-memory store read back by the real :class:`StagedReader`) and verifies them
with :func:`prepare_ledger`, the function :func:`prepare_shard` hands a read ledger to.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.config import BatchConfig, ModelSpec
from tasks.finalize.verify.shard import prepare_ledger
from tasks.records.ledger import CallRecord, FailureRow, Receipt, StagedDelta
from tasks.records.planned import PlannedRollout
from tasks.records.sampling_mask import KEPT_NOTE, KeptSets
from tasks.sampling import SamplingSettings
from tasks.storage.ledger_files import RolloutBundle
from tasks.storage.ledger_reader import LedgerTables
from tasks.storage.objects import ObjectStore
from tasks.storage.staged_reader import StagedReader

from .verdicts import VerifiedRollout, rollouts_of

SEGMENT = "staging/shard-00000/attempt-00/seg-000000.parquet"
CONFIG = BatchConfig(
    batch_id="b-unit",
    environment="arithmetic",
    num_tasks=1,
    group_size=1,
    shards=1,
    model=ModelSpec(reference="fake-model"),
    sampling=SamplingSettings(temperature=1.0),
)


@dataclasses.dataclass
class Chain:
    """A rollout's staged deltas and their call records, root→terminal."""

    deltas: list[StagedDelta]
    records: list[CallRecord]

    def table(self, order: list[int] | None = None) -> pa.Table:
        picked = self.deltas if order is None else [self.deltas[i] for i in order]
        return StagedDelta.to_table(picked)


def build_chain(
    turns: list[tuple[int, int]],
    *,
    rollout_id: str = "r000000-00",
    finish_reason: str = "stop",
    weight_versions: list[int] | None = None,
    epoch_spans: list[bool] | None = None,
    first_id: int = 100,
    first_row: int = 0,
    sampling: SamplingSettings = CONFIG.sampling,
    kept: bool = False,
) -> Chain:
    """A linear chain: turn k carries ``carry`` new prompt tokens and samples ``gen`` tokens, with ``sampling``.

    Its calls' staging coordinates are rows ``first_row``, ``first_row + 1``, ... of :data:`SEGMENT`. With
    ``kept``, each call stages its sampled tokens' kept sets (:func:`hand_kept_sets`) and names them in its extras.
    """
    deltas, records = [], []
    sequence = np.zeros(0, np.int64)
    parent: StagedDelta | None = None
    next_id = first_id
    for k, (carry, gen) in enumerate(turns):
        prompt = np.concatenate([sequence, np.arange(next_id, next_id + carry)])
        generated = np.arange(next_id + carry, next_id + carry + gen)
        next_id += carry + gen
        sets = hand_kept_sets(generated) if kept else None
        delta = StagedDelta.build(
            batch_id=CONFIG.batch_id,
            rollout_id=rollout_id,
            call_id=f"{rollout_id}.a00.c{k:03d}",
            parent_call_id=parent.call_id if parent else None,
            parent_chain_hash=parent.chain_hash if parent else None,
            prefix_token_ids=sequence,
            prompt_token_ids=prompt,
            generated_token_ids=generated,
            generated_logprobs=-np.linspace(0.1, 1.0, gen, dtype=np.float32),
            weight_version=(weight_versions or [0] * len(turns))[k],
            finish_reason=finish_reason if k == len(turns) - 1 else "stop",
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            kept=sets,
            extras={KEPT_NOTE: sets.note()} if sets else None,
        )
        record = CallRecord.for_staged(
            delta,
            staging_segment=SEGMENT,
            staging_row=first_row + k,
            admitted_at=1000.0 + k,
            epoch_span=(epoch_spans or [False] * len(turns))[k],
        )
        deltas.append(delta)
        records.append(record)
        sequence = np.concatenate([prompt, generated])
        parent = delta
    return Chain(deltas, records)


def hand_kept_sets(sampled: np.ndarray) -> KeptSets:
    """Each sampled token's kept set in hand-built chains: the token and the ids one and two above it."""
    return KeptSets.of(range(int(t), int(t) + 3) for t in sampled)


def receipt_for(chain: Chain, **overrides: object) -> Receipt:
    fields = {
        "rollout_id": chain.records[0].rollout_id,
        "group_id": "g000000",
        "attempt": 0,
        "reward": 1.0,
        "reward_info": "{}",
        "terminal_call_id": chain.records[-1].call_id,
        "terminal_selection": "declared",
        "terminal_attribution_reason": "selected",
        "status": "ok",
        "failure_reason": None,
        "num_calls": len(chain.records),
    } | overrides
    return Receipt(**fields)


def bundle_of(chain: Chain, receipt: Receipt | None = None, failures: tuple[FailureRow, ...] = ()) -> RolloutBundle:
    return RolloutBundle(receipt=receipt or receipt_for(chain), manifest=tuple(chain.records), failures=failures)


def failure(chain: Chain, call_id: str, reason: str) -> FailureRow:
    return FailureRow(
        batch_id=CONFIG.batch_id,
        rollout_id=chain.records[0].rollout_id,
        call_id=call_id,
        parent_call_id=None,
        reason=reason,
        detail="",
    )


def verify_rollouts(
    bundles: Sequence[RolloutBundle],
    staged: pa.Table,
    config: BatchConfig = CONFIG,
    *,
    segment_sha256: Mapping[str, str] | None = None,
) -> list[VerifiedRollout]:
    """The verdict of each receipted rollout (one planned rollout each, in order) through finalization's path.

    ``staged`` is written as the one staging segment :data:`SEGMENT` (any Parquet table: a broken
    schema is the reader's to refuse); ``segment_sha256`` is what a shard marker would vouch for
    (None: no checksum). The ledger belongs to batch ``CONFIG.batch_id``.
    """
    store = ObjectStore(f"memory://finalize-tests/{uuid.uuid4().hex}")
    sink = pa.BufferOutputStream()
    pq.write_table(staged, sink)
    store.write_once(SEGMENT, sink.getvalue().to_pybytes())
    calls = [call for bundle in bundles for call in bundle.manifest]
    failures = [row for bundle in bundles for row in bundle.failures]
    tables = LedgerTables(
        calls=CallRecord.to_table(calls),
        call_attempts=np.zeros(len(calls), np.int64),
        failures=FailureRow.to_table(failures),
        failure_attempts=np.zeros(len(failures), np.int64),
        receipts=Receipt.to_table([bundle.receipt for bundle in bundles]),
    )
    plan = [
        PlannedRollout(
            rollout_id=bundle.rollout_id,
            group_id=bundle.receipt.group_id,
            task_index=task,
            sample_index=0,
            seed=task,
            task_json="{}",
        )
        for task, bundle in enumerate(bundles)
    ]
    reader = StagedReader(store, segment_sha256=segment_sha256)
    prepared = prepare_ledger(config, 0, plan, tables, ledger_batch_id=CONFIG.batch_id, reader=reader)
    return rollouts_of(prepared.verify())


def verify_one(bundle: RolloutBundle, staged: pa.Table, config: BatchConfig = CONFIG, **options) -> VerifiedRollout:
    """:func:`verify_rollouts` of one rollout."""
    (verified,) = verify_rollouts([bundle], staged, config, **options)
    return verified
