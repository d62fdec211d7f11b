"""Sampling masks through finalization: a truncated batch's rows carry their calls' kept sets, or never train.

Hand-built chains (real record builders, finalization's own path) prove each check by its reason: a truncating
call without kept sets (staged by older code) is ``sampling_mask_missing``, kept sets that do not fit their tokens
or sit on an untruncated call ``invalid_sampling_mask``, ones that are not the sets the extras name
``corrupt_sampling_mask``. A batch of the fake scripted engine with masks (real tokenizer, real storage) goes
through finalize: every row says the batch's sampling and holds its sampled tokens' kept sets in order; a call
re-staged as older code staged it masks its row, named.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest

from tasks.batch import Batch
from tasks.config import ModelSpec
from tasks.finalize import reasons
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shard
from tasks.plan import plan_batch
from tasks.records import digest as dg
from tasks.records.dataset_row import DatasetRow
from tasks.records.ledger import StagedDelta, canonical_json
from tasks.records.sampling_mask import KEPT_NOTE, KeptSets
from tasks.sampling import SamplingSettings
from tasks.storage.dataset_manifest import read_dataset_part
from tasks.trainer.collate import GrpoCollator, PublishedDataset

from .conftest import CommittedBatch, fresh_copy, guess_number_config
from .hand_built import CONFIG, build_chain, bundle_of, hand_kept_sets, verify_one
from .tamper import BatchFiles, redigest

TRUNCATED = SamplingSettings(temperature=0.9, top_p=0.9, top_k=50, max_tokens=24)
TRUNCATED_CONFIG = dataclasses.replace(CONFIG, sampling=TRUNCATED)
TURNS = [(3, 2), (2, 3), (1, 2)]
NO_AUDIT = FinalizeOptions(audit=False)


def _edited(table: pa.Table, row: int, **changes: object) -> pa.Table:
    """The staged table with ``changes`` to one row's fields (through Arrow, not the record)."""
    rows = table.to_pylist()
    rows[row].update(changes)
    return pa.Table.from_pylist(rows, schema=StagedDelta.arrow_schema())


def test_a_truncated_chain_verifies_with_its_calls_kept_sets_in_sampled_token_order():
    chain = build_chain(TURNS, sampling=TRUNCATED, kept=True)
    verified = verify_one(bundle_of(chain), chain.table(), TRUNCATED_CONFIG)
    assert verified.reason is None
    sampled = verified.input_ids[verified.loss_mask == 1]
    assert len(verified.kept) == sampled.size == 7
    expected = [s.tolist() for delta in chain.deltas for s in delta.kept.sets()]
    assert (
        [s.tolist() for s in verified.kept.sets()] == expected == [s.tolist() for s in hand_kept_sets(sampled).sets()]
    )


def test_a_chain_sampled_otherwise_than_the_batch_config_is_masked_by_the_field_that_differs():
    for other, reason in (
        (dataclasses.replace(TRUNCATED, top_p=0.8), "wrong_top_p"),
        (dataclasses.replace(TRUNCATED, top_k=-1), "wrong_top_k"),
        (dataclasses.replace(TRUNCATED, temperature=1.0), "wrong_temperature"),
    ):
        chain = build_chain(TURNS, sampling=other, kept=True)  # a well-formed mask, of other settings
        assert verify_one(bundle_of(chain), chain.table(), TRUNCATED_CONFIG).reason == reason


def test_a_truncating_call_staged_without_kept_sets_masks_its_rollout_as_sampling_mask_missing():
    chain = build_chain(TURNS, sampling=TRUNCATED)  # as code before kept sets staged it: valid digests, no mask
    verified = verify_one(bundle_of(chain), chain.table(), TRUNCATED_CONFIG)
    assert verified.reason == reasons.SAMPLING_MASK_MISSING == "sampling_mask_missing"
    assert not verified.linearized  # its tokens never reach a row


def test_kept_sets_on_a_call_whose_sampling_does_not_truncate_are_invalid():
    chain = build_chain(TURNS, kept=True)  # the untruncated CONFIG's sampling
    assert verify_one(bundle_of(chain), chain.table()).reason == reasons.INVALID_SAMPLING_MASK


def test_kept_sets_that_do_not_fit_their_sampled_tokens_are_invalid():
    chain = build_chain(TURNS, sampling=TRUNCATED, kept=True)
    table = chain.table()
    sampled = chain.deltas[1].token_ids_delta[np.asarray(chain.deltas[1].token_mask_delta) == 1]
    beside = KeptSets.of([[int(t) + 1, int(t) + 2] for t in sampled])  # the right sizes, never the token
    short = KeptSets.of([[int(t)] for t in sampled[:-1]])
    for kept in (beside, short):
        edited = _edited(table, 1, kept_counts=kept.counts.tolist(), kept_token_ids=kept.token_ids.tolist())
        assert verify_one(bundle_of(chain), edited, TRUNCATED_CONFIG).reason == reasons.INVALID_SAMPLING_MASK


def test_kept_sets_that_are_not_the_ones_the_extras_name_are_corrupt():
    chain = build_chain(TURNS, sampling=TRUNCATED, kept=True)
    table = chain.table()
    ids = chain.deltas[2].kept_token_ids.tolist()
    ids[2] += 10  # the first set stays ascending and holds its token: only the digest tells
    edited = _edited(table, 2, kept_token_ids=ids)
    assert verify_one(bundle_of(chain), edited, TRUNCATED_CONFIG).reason == reasons.CORRUPT_SAMPLING_MASK


@pytest.fixture(scope="module")
def truncated_batch(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> CommittedBatch:
    """A committed guess_number shard sampled with top-p 0.9 / top-k 50 by the fake engine with masks."""
    from tests.generation.fakes import FakeScriptedEngine

    root = tmp_path_factory.mktemp("truncated-batch")
    config = guess_number_config("b-masks", ModelSpec(reference="fake-model"), sampling=TRUNCATED)
    plan_batch(Batch.open(str(root), config.batch_id), config)
    engine = FakeScriptedEngine(tokenizer, masks=True, reply=lambda request: str(request.seed % 8 + 1))
    generate_shard(Batch.open(str(root), config.batch_id), 0, engine=engine, run=asyncio.run, progress=False)
    return CommittedBatch(root=root, config=config)


def _finalized_rows(batch: CommittedBatch) -> tuple[pa.Table, list[DatasetRow]]:
    staged = finalize_batch(batch.handle, NO_AUDIT)
    assert staged.marker.schema_version == 3
    table = pa.concat_tables([read_dataset_part(batch.store, part) for part in staged.marker.parts])
    return table, DatasetRow.from_table(table)  # every row invariant holds


def test_a_truncated_batch_finalizes_rows_holding_their_sampling_and_kept_sets(truncated_batch, tmp_path):
    from tests.generation.fakes import scripted_kept_sets

    batch = fresh_copy(truncated_batch, tmp_path)
    table, rows = _finalized_rows(batch)
    assert len(rows) == 6 and all(row.sample_mask == 1 for row in rows)
    for row in rows:
        assert (row.temperature, row.top_p, row.top_k, row.logprobs_mode) == (0.9, 0.9, 50, "processed")
        sampled = row.input_ids[row.loss_mask == 1]
        assert len(row.kept) == sampled.size > 0
        assert [s.tolist() for s in row.kept.sets()] == [s.tolist() for s in scripted_kept_sets(sampled).sets()]
    # the trainer's flat view: every kept id sits at a sampled position whose token is in its set
    data = PublishedDataset(table)
    collated = GrpoCollator()([data[i] for i in range(len(data))])
    assert collated["truncates"].all() and collated["sampling_recorded"].all()
    counts = collated["kept_counts"]
    assert (counts > 0).eq(collated["loss_mask"] > 0).all()
    positions, kept_ids = collated["kept_positions"], collated["kept_token_ids"]
    assert kept_ids.numel() == sum(int(row.kept.counts.sum()) for row in rows)
    holds = kept_ids == collated["input_ids"].flatten()[positions]
    assert int(holds.sum()) == int(collated["loss_mask"].sum())  # each token once in its own set


def _as_older_code_staged_it(row: dict) -> None:
    """A staged call without its kept sets and without their digest in its extras, resealed by its digests."""
    extras = json.loads(row["extras_json"])
    extras.pop(KEPT_NOTE)
    extras = extras or None
    row.update(
        kept_counts=[],
        kept_token_ids=[],
        extras_json=canonical_json(extras),
        extras_digest=dg.compute_extras_digest(extras),
    )
    redigest(row)


def test_a_call_staged_without_kept_sets_masks_its_row_in_a_finalized_batch(truncated_batch, tmp_path):
    batch = fresh_copy(truncated_batch, tmp_path)
    files = BatchFiles(batch.dir)
    rollout = "r000001-00"
    call_id = f"{rollout}.a00.c001"
    files.edit_staged(call_id, _as_older_code_staged_it)
    files.sync_call(call_id, "extras_digest", "digest")
    _, rows = _finalized_rows(batch)
    (masked,) = [row for row in rows if row.rollout_id == rollout]
    assert (masked.sample_mask, masked.mask_reason, masked.input_ids.size) == (0, "sampling_mask_missing", 0)
    assert masked.top_p == 0.9 and not masked.kept  # the batch's sampling, and no mask it does not have
    assert all(row.sample_mask == 1 and row.kept for row in rows if row.rollout_id != rollout)
