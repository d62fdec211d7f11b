"""Verification and linearization through finalization's path: hand-built chains and fake-engine shards (fast)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks import layout
from tasks.capture import terminal
from tasks.errors import UncommittedShardError
from tasks.finalize import reasons as r
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.finalize.verify.guards import OFF_CHAIN_TOLERATED_FAILURE
from tasks.finalize.verify.shard import prepare_shard
from tasks.sampling import SamplingSettings
from tasks.storage.ledger_files import RolloutBundle
from tasks.storage.objects import ObjectStore
from tests.generation.chains import linearized, verified_sequences

from .conftest import CommittedBatch, fresh_copy
from .hand_built import CONFIG, SEGMENT, Chain, build_chain, bundle_of, failure, receipt_for, verify_one
from .tamper import BatchFiles
from .verdicts import rollouts_of


def test_a_clean_chain_linearizes_root_to_terminal_with_spans() -> None:
    chain = build_chain([(5, 3), (2, 4), (1, 2)], weight_versions=[3, 3, 4], epoch_spans=[False, True, False])
    verified = verify_one(bundle_of(chain), chain.table())
    assert verified.reason is None and verified.valid
    assert np.array_equal(verified.input_ids, np.arange(100, 117))
    assert verified.input_ids.dtype == np.int32
    assert verified.loss_mask.tolist() == [0] * 5 + [1] * 3 + [0] * 2 + [1] * 4 + [0] + [1] * 2
    assert verified.logprobs.dtype == np.float32
    assert (verified.logprobs[verified.loss_mask == 0] == 0).all() and (
        verified.logprobs[verified.loss_mask == 1] < 0
    ).all()
    assert verified.prompt_len == 5 and verified.num_turns == 3 and verified.epoch_span_count == 1
    assert [(s.carry_len, s.gen_len) for s in verified.call_spans] == [(5, 3), (2, 4), (1, 2)]
    assert [(w.start, w.end, w.weight_version) for w in verified.weight_spans] == [(0, 8, 3), (8, 14, 3), (14, 17, 4)]
    assert (verified.batch_id, verified.group_id, verified.reward) == ("b-unit", "g000000", 1.0)
    assert verified.terminal_selection == "declared" and not verified.truncated


def test_a_terminal_that_stopped_on_length_is_truncated() -> None:
    chain = build_chain([(4, 2), (1, 3)], finish_reason="length")
    assert verify_one(bundle_of(chain), chain.table()).truncated


@pytest.mark.parametrize(
    ("status", "failure_reason", "expected"),
    [
        ("failed", "environment_error", r.ROLLOUT_FAILED),
        ("poisoned", "staging_failed", r.CAPTURE_POISONED),
        ("poisoned", terminal.AMBIGUOUS_TERMINAL, terminal.AMBIGUOUS_TERMINAL),
        ("poisoned", terminal.DECLARED_TERMINAL_NOT_CAPTURED, terminal.DECLARED_TERMINAL_NOT_CAPTURED),
        ("poisoned", r.NO_REWARD, r.NO_REWARD),
    ],
)
def test_a_receipt_without_terminal_keeps_its_status_reason(status: str, failure_reason: str, expected: str) -> None:
    chain = build_chain([(3, 2), (1, 2)])
    receipt = receipt_for(
        chain,
        status=status,
        failure_reason=failure_reason,
        terminal_call_id=None,
        terminal_selection=None,
        terminal_attribution_reason=None,
    )
    verified = verify_one(bundle_of(chain, receipt), chain.table())
    assert verified.reason == expected and not verified.linearized


def test_a_poisoned_receipt_that_names_a_clean_terminal_keeps_the_verified_tokens() -> None:
    chain = build_chain([(3, 2), (1, 2)])
    receipt = receipt_for(chain, status="poisoned", failure_reason="ledger_failed")
    verified = verify_one(bundle_of(chain, receipt), chain.table())
    assert verified.reason == r.CAPTURE_POISONED and verified.linearized and verified.input_ids.size == 8


def test_any_failure_row_poisons_but_keeps_the_verified_tokens() -> None:
    chain = build_chain([(3, 2), (1, 2)])
    bundle = bundle_of(chain, failures=(failure(chain, "r000000-00.a00.c009", "engine_error"),))
    verified = verify_one(bundle, chain.table())
    assert verified.reason == r.CAPTURE_POISONED and verified.linearized


def test_a_tolerated_failure_poisons_only_on_the_selected_chain() -> None:
    chain = build_chain([(3, 2), (1, 2)])
    off_chain = bundle_of(chain, failures=(failure(chain, "r000000-00.a00.c009", OFF_CHAIN_TOLERATED_FAILURE),))
    assert verify_one(off_chain, chain.table()).valid
    on_chain = bundle_of(chain, failures=(failure(chain, chain.records[1].call_id, OFF_CHAIN_TOLERATED_FAILURE),))
    assert verify_one(on_chain, chain.table()).reason == r.CAPTURE_POISONED


def test_heuristic_receipts_are_reattributed_on_the_manifest() -> None:
    chain = build_chain([(3, 2), (1, 2), (1, 1)])
    agreed = receipt_for(chain, terminal_selection="heuristic")
    assert verify_one(bundle_of(chain, agreed), chain.table()).valid
    short = Chain(chain.deltas[:2], chain.records[:2])
    disagreeing = receipt_for(chain, terminal_selection="heuristic", terminal_call_id=chain.records[1].call_id)
    assert verify_one(bundle_of(chain, disagreeing), short.table()).reason == terminal.WITNESS_DISAGREEMENT


def test_a_heuristic_receipt_over_a_manifest_with_an_orphan_is_rejected_with_the_heuristic_reason() -> None:
    chain = build_chain([(3, 2), (1, 2)])
    orphan = dataclasses.replace(chain.records[1], call_id="r000000-00.a00.c007", parent_call_id="r000000-00.a00.c008")
    records = [*chain.records, dataclasses.replace(orphan, staging_row=5)]
    bundle = RolloutBundle(receipt_for(chain, terminal_selection="heuristic", num_calls=3), tuple(records), ())
    assert verify_one(bundle, chain.table()).reason == terminal.ORPHANED_ROW


def test_a_fetch_failure_reason_is_reported_for_the_rollout() -> None:
    chain = build_chain([(3, 2)])
    vouched = {SEGMENT: "0" * 64}  # the marker vouches for other bytes
    assert verify_one(bundle_of(chain), chain.table(), segment_sha256=vouched).reason == r.SEGMENT_CHECKSUM_MISMATCH


def test_rows_out_of_chain_order_or_missing_are_named() -> None:
    chain = build_chain([(3, 2), (1, 2)])
    assert verify_one(bundle_of(chain), chain.table([1, 0])).reason == r.CALL_ID_MISMATCH
    assert verify_one(bundle_of(chain), chain.table([0])).reason == r.MISSING_STAGING_ROW
    missing_column = chain.table().drop_columns(["top_k"])
    assert verify_one(bundle_of(chain), missing_column).reason == r.INVALID_STAGED_ROW


def test_sampling_settings_are_checked_against_the_batch_config() -> None:
    chain = build_chain([(3, 2)])
    other = dataclasses.replace(CONFIG, sampling=SamplingSettings(temperature=0.5))
    assert verify_one(bundle_of(chain), chain.table(), other).reason == r.wrong("temperature")
    assert verify_one(bundle_of(chain), chain.table(), dataclasses.replace(CONFIG, batch_id="b-x")).reason == (
        r.wrong("batch_id")
    )


def replace_list_value(table: pa.Table, column: str, row: int, position: int, value: float) -> pa.Table:
    cells = table.column(column).to_pylist()
    cells[row][position] = value
    return table.set_column(
        table.schema.get_field_index(column), column, pa.array(cells, table.schema.field(column).type)
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    turns=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=4),
    data=st.data(),
)
def test_any_single_changed_value_in_any_row_is_never_a_valid_rollout(turns: list[tuple[int, int]], data) -> None:
    chain = build_chain(turns)
    clean = verify_one(bundle_of(chain), chain.table())
    assert clean.valid and np.array_equal(clean.input_ids, linearized(chain.deltas))
    row = data.draw(st.integers(0, len(turns) - 1))
    position = data.draw(st.integers(0, chain.deltas[row].delta_len - 1))
    column = data.draw(st.sampled_from(["token_ids_delta", "token_mask_delta", "logprobs_delta"]))
    old = chain.table().column(column)[row].as_py()[position]
    value = data.draw(
        st.one_of(st.integers(-3, 2**31 + 5).map(float), st.floats(allow_nan=True, width=32)).filter(lambda v: v != old)
    )
    if column == "token_ids_delta":
        value = int(value) if np.isfinite(value) and abs(value) < 2**62 else 7
        if value == old:
            value = old + 1
    tampered = replace_list_value(chain.table(), column, row, position, value)
    verified = verify_one(bundle_of(chain), tampered)
    assert verified.reason in {r.INVALID_STAGED_ROW, r.CORRUPT_DIGEST}


# --- committed fake-engine shards -------------------------------------------------------------


def test_a_fake_engine_shard_linearizes_every_rollout_to_its_staged_chain(fake_batch: CommittedBatch) -> None:
    results = fake_batch.verify()
    store = fake_batch.handle.store
    chains = verified_sequences(store, 0)
    assert len(results) == fake_batch.config.num_rollouts and set(chains) == set(results)
    for rollout_id, deltas in chains.items():
        verified = results[rollout_id]
        assert verified.valid, (rollout_id, verified.reason)
        assert np.array_equal(verified.input_ids, linearized(deltas))
        assert np.array_equal(verified.loss_mask, np.concatenate([d.token_mask_delta for d in deltas]).astype(np.uint8))
        assert np.array_equal(verified.logprobs, np.concatenate([d.logprobs_delta for d in deltas]))


def test_each_staging_segment_is_read_once_for_the_whole_shard(
    fake_batch: CommittedBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    original = ObjectStore.read_bytes

    def counting(self: ObjectStore, relative: str) -> bytes:
        reads.append(relative)
        return original(self, relative)

    monkeypatch.setattr(ObjectStore, "read_bytes", counting)
    results = fake_batch.verify()
    staging_reads = [path for path in reads if path.startswith("staging/")]
    assert staging_reads and len(staging_reads) == len(set(staging_reads))
    assert sum(v.num_turns for v in results.values()) > len(staging_reads)


def test_a_bad_segment_rejects_only_the_rollouts_that_read_it(fake_batch: CommittedBatch, tmp_path: Path) -> None:
    batch = fresh_copy(fake_batch, tmp_path)
    files = BatchFiles(batch.dir)
    segments = files.files("staging")
    victim = segments[0]
    (batch.dir / victim).write_bytes(b"not parquet")
    bundles = batch.bundles()
    readers = {rid for rid, b in bundles.items() if any(c.staging_segment == victim for c in b.manifest)}
    results = batch.verify()
    for rollout_id, verified in results.items():
        expected = r.SEGMENT_CHECKSUM_MISMATCH if rollout_id in readers else None
        assert verified.reason == expected, rollout_id


def test_an_unreadable_ledger_rejects_every_planned_rollout(fake_batch: CommittedBatch, tmp_path: Path) -> None:
    batch = fresh_copy(fake_batch, tmp_path)
    calls = BatchFiles(batch.dir).files("calls")[0]
    (batch.dir / calls).write_bytes(b"rot")
    results = batch.verify()
    assert len(results) == batch.config.num_rollouts
    assert {v.reason for v in results.values()} == {r.SEGMENT_CHECKSUM_MISMATCH}


def test_a_planned_rollout_without_receipt_is_missing(fake_batch: CommittedBatch, tmp_path: Path) -> None:
    batch = fresh_copy(fake_batch, tmp_path)
    files = BatchFiles(batch.dir)
    dropped = files.read_rows(files.files("receipts")[0])[0]["rollout_id"]
    files.edit_rows(files.files("receipts")[0], lambda rows: rows.pop(0))
    results = batch.verify()
    assert results[dropped].reason == r.MISSING_RECEIPT and results[dropped].group_id
    assert all(v.valid for rid, v in results.items() if rid != dropped)


def test_a_missing_receipt_is_counted_as_missing_not_as_a_receipt(fake_batch: CommittedBatch, tmp_path: Path) -> None:
    batch = fresh_copy(fake_batch, tmp_path)
    files = BatchFiles(batch.dir)
    files.edit_rows(files.files("receipts")[0], lambda rows: rows.pop(0))
    finalize_batch(batch.handle, FinalizeOptions(audit=False))
    metrics = json.loads((batch.dir / layout.DATASET_METRICS).read_text())
    assert (metrics["planned_rollouts"], metrics["receipts"], metrics["missing_receipts"]) == (
        batch.config.num_rollouts,
        batch.config.num_rollouts - 1,
        1,
    )


def test_an_uncommitted_shard_is_refused_not_rejected_row_by_row(fake_batch: CommittedBatch, tmp_path: Path) -> None:
    batch = fresh_copy(fake_batch, tmp_path)
    BatchFiles(batch.dir).marker_path.unlink()
    with pytest.raises(UncommittedShardError):
        batch.verify()


def test_a_config_of_another_batch_rejects_every_rollout_as_wrong_batch(fake_batch: CommittedBatch) -> None:
    other = dataclasses.replace(fake_batch.config, batch_id="b-other")
    assert {v.reason for v in rollouts_of(prepare_shard(fake_batch.handle, 0, other).verify())} == {r.wrong("batch_id")}


# --- the reason catalogue ---------------------------------------------------------------------


def test_every_reason_is_unique_snake_case_and_described() -> None:
    assert len(set(r.ALL_REASONS)) == len(r.ALL_REASONS)
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", reason) for reason in r.ALL_REASONS)
    assert all(r.DESCRIPTIONS[reason] for reason in r.ALL_REASONS)
    assert set(terminal.ATTRIBUTION_REASONS) - {terminal.SELECTED} <= set(r.ALL_REASONS)
    assert {"wrong_batch_id", "wrong_finish_reason", "wrong_top_k", "wrong_logprobs_mode"} <= set(r.ALL_REASONS)


def test_wrong_refuses_a_field_that_is_not_compared() -> None:
    with pytest.raises(ValueError, match="not a compared field"):
        r.wrong("admitted_at")
