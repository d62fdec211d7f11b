"""Records: invariants enforced at construction, and one Arrow schema per record."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.errors import SchemaMismatchError
from tasks.records import digest as dg
from tasks.records.ledger import CallRecord, FailureRow, Receipt, StagedDelta, canonical_json
from tasks.records.sampling_mask import KeptSets

STAGED_COLUMNS = (
    "schema_version, digest_version, extras_digest_version, batch_id, rollout_id, call_id, parent_call_id, mode, "
    "prev_len, delta_len, cum_len, weight_version, token_ids_delta, token_mask_delta, logprobs_delta, extras_json, "
    "extras_digest, chain_hash, cumulative_hash, digest, finish_reason, temperature, top_p, top_k, logprobs_mode, "
    "kept_counts, kept_token_ids"
).split(", ")

SEGMENT = "staging/shard-00000/attempt-00/seg-000000.parquet"


def build_root(**overrides) -> StagedDelta:
    kwargs = {
        "batch_id": "b1",
        "rollout_id": "r000000-00",
        "call_id": "r000000-00.a00.c000",
        "parent_call_id": None,
        "parent_chain_hash": None,
        "prefix_token_ids": [],
        "prompt_token_ids": [1, 2, 3],
        "generated_token_ids": [4, 5],
        "generated_logprobs": [-0.5, -0.25],
        "weight_version": 0,
        "finish_reason": "stop",
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
    } | overrides
    return StagedDelta.build(**kwargs)


def build_child(parent: StagedDelta, **overrides) -> StagedDelta:
    prefix = np.concatenate([[1, 2, 3], parent.token_ids_delta[3:]]) if parent.mode == "text" else None
    kwargs = {
        "batch_id": "b1",
        "rollout_id": parent.rollout_id,
        "call_id": "r000000-00.a00.c001",
        "parent_call_id": parent.call_id,
        "parent_chain_hash": parent.chain_hash,
        "prefix_token_ids": prefix,
        "prompt_token_ids": np.concatenate([prefix, [6, 7]]),
        "generated_token_ids": [8],
        "generated_logprobs": [-1.0],
        "weight_version": 0,
        "finish_reason": "length",
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "extras": {"routed_experts": [[1, 2]]},
    } | overrides
    return StagedDelta.build(**kwargs)


def test_staged_delta_columns_are_exactly_the_contract():
    assert StagedDelta.column_names() == STAGED_COLUMNS
    schema = StagedDelta.arrow_schema()
    assert schema.field("token_ids_delta").type == pa.list_(pa.int64())
    assert schema.field("token_mask_delta").type == pa.list_(pa.float32())
    assert schema.field("logprobs_delta").type == pa.list_(pa.float32())
    assert schema.field("weight_version").type == pa.uint64()
    assert schema.field("parent_call_id").nullable and not schema.field("call_id").nullable


def test_build_computes_delta_mask_and_hashes():
    root = build_root()
    assert root.mode == "text" and root.prev_len == 0 and root.delta_len == 5 and root.cum_len == 5
    assert root.token_mask_delta.tolist() == [0, 0, 0, 1, 1]
    assert root.logprobs_delta.tolist() == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert root.cumulative_hash == dg.hash_token_ids([1, 2, 3, 4, 5])
    assert root.chain_hash == dg.chain_hash(None, [1, 2, 3, 4, 5])
    assert root.recompute_digest() == root.digest
    child = build_child(root)
    assert child.mode == "token_in" and child.prev_len == 5 and child.cum_len == 8
    assert child.token_ids_delta.tolist() == [6, 7, 8]
    assert child.cumulative_hash == dg.hash_token_ids([1, 2, 3, 4, 5, 6, 7, 8])
    assert child.chain_hash == dg.chain_hash(root.chain_hash, [6, 7, 8])
    assert child.extras_json == '{"routed_experts":[[1,2]]}'


def test_build_refuses_a_prompt_that_does_not_extend_the_parent():
    root = build_root()
    with pytest.raises(ValueError, match="does not start with its parent"):
        build_child(root, prompt_token_ids=[1, 2, 3, 4, 9, 6])


def test_list_fields_are_read_only():
    root = build_root()
    with pytest.raises(ValueError, match="read-only"):
        root.token_ids_delta[0] = 99


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"batch_id": "../x"}, "batch_id"),
        ({"schema_version": 3}, "schema_version"),
        ({"digest": "xyz"}, "digest"),
        ({"cum_len": 6}, "cum_len"),
        ({"token_mask_delta": np.array([0, 0, 0, 1, 0.5], np.float32)}, "token_mask_delta"),
        ({"logprobs_delta": np.array([0, 0, -1, -0.5, -0.25], np.float32)}, "logprobs_delta"),
        ({"logprobs_delta": np.array([0, 0, 0, math.nan, -0.25], np.float32)}, "logprobs_delta"),
        ({"token_ids_delta": np.array([1, 2, 3, 4], np.int64)}, "token_ids_delta"),
        ({"extras_json": '{"a": 1}'}, "canonical"),
        ({"extras_json": "{"}, "extras_json"),
        ({"extras_json": '{"a":1}'}, "extras_digest"),
        ({"parent_call_id": "p"}, "parent_call_id"),
        ({"top_k": -2}, "top_k"),
        ({"temperature": math.inf}, "temperature"),
        ({"logprobs_mode": "raw"}, "logprobs_mode"),
        ({"finish_reason": ""}, "finish_reason"),
        ({"mode": "chat"}, "mode"),
        ({"prev_len": 1, "cum_len": 6}, "prev_len 1 contradicts mode 'text'"),
        ({"delta_len": 0, "cum_len": 0}, "delta_len"),
        ({"top_k": 2**31}, "top_k"),
        ({"weight_version": -1}, "weight_version"),
    ],
)
def test_staged_delta_invariants_are_enforced_at_construction(change, match):
    fields = build_root().to_row() | change
    with pytest.raises((ValueError, TypeError), match=match):
        StagedDelta(**fields)


def test_staged_delta_round_trips_through_its_arrow_schema():
    root = build_root()
    child = build_child(root)
    table = StagedDelta.to_table([root, child])
    assert table.schema == StagedDelta.arrow_schema()
    assert StagedDelta.from_table(table) == [root, child]


def masked_child(root: StagedDelta, kept: KeptSets, **overrides) -> StagedDelta:
    """A top-p / top-k child whose one sampled token (8) kept ``kept``, its digest named in its extras."""
    extras = {"sampling": kept.note(), "engine": {"routed_experts": [[1, 2]]}}
    return build_child(root, kept=kept, extras=extras, **overrides)


def test_a_delta_keeps_its_sampling_mask_and_its_digest_covers_it():
    root = build_root()
    kept = KeptSets.of([[3, 8, 11]])
    child = masked_child(root, kept)
    assert child.kept_counts.tolist() == [3] and child.kept_token_ids.tolist() == [3, 8, 11]
    assert StagedDelta.from_table(StagedDelta.to_table([root, child])) == [root, child]
    other = masked_child(root, KeptSets.of([[8, 11]]))
    assert other.extras_digest != child.extras_digest and other.digest != child.digest
    assert other.chain_hash == child.chain_hash  # the chain links tokens; each link's digest covers its mask
    assert root.kept_counts.size == 0 and not root.kept  # no truncation: no mask


def test_a_mask_altered_after_the_fact_is_refused_when_read():
    child = masked_child(build_root(), KeptSets.of([[3, 8, 11]]))
    fields = child.to_row() | {"kept_token_ids": np.array([3, 8, 12], np.int32)}
    with pytest.raises(ValueError, match="do not name the digest of its kept sets"):
        StagedDelta(**fields)


@pytest.mark.parametrize(
    ("kept", "extras", "match"),
    [
        (KeptSets.of([[3, 11]]), None, "not in its own kept set"),
        (KeptSets.of([[8], [9]]), None, "2 counts for 1 sampled tokens"),
        (KeptSets.of([[8, 9]]), {"engine": 1}, "do not name the digest"),
        (KeptSets.empty(), {"sampling": {"kept_sha256": "0" * 64}}, "name kept sets it does not hold"),
    ],
)
def test_build_refuses_a_mask_that_does_not_fit_its_call(kept, extras, match):
    root = build_root()
    extras = {"sampling": kept.note()} if extras is None else extras
    with pytest.raises(ValueError, match=match):
        build_child(root, kept=kept, extras=extras)


def test_a_segment_written_before_masks_reads_with_none():
    table = StagedDelta.to_table([build_root(), build_child(build_root())]).drop_columns(
        ["kept_counts", "kept_token_ids"]
    )
    upgraded = StagedDelta.upgrade(table)
    old = StagedDelta.from_table(upgraded)
    assert [delta.kept_counts.size for delta in old] == [0, 0]
    assert old[1].digest == build_child(build_root()).digest  # the digest never covered the (absent) columns


def test_check_table_names_missing_extra_and_mistyped_columns():
    table = StagedDelta.to_table([build_root()])
    broken = table.drop_columns(["digest"]).append_column("surprise", pa.array([1]))
    broken = broken.set_column(broken.schema.get_field_index("top_k"), "top_k", pa.array([1], pa.int64()))
    with pytest.raises(SchemaMismatchError) as caught:
        StagedDelta.check_table(broken, source="seg-1")
    message = str(caught.value)
    assert "seg-1" in message and "'digest'" in message and "surprise" in message and "top_k" in message


@settings(max_examples=50)
@given(
    prompt=st.lists(st.integers(0, 49151), min_size=1, max_size=20),
    generated=st.lists(st.integers(0, 49151), min_size=0, max_size=20),
    weight_version=st.integers(0, 2**64 - 1),
)
def test_any_built_delta_round_trips_and_its_digest_recomputes(prompt, generated, weight_version):
    logprobs = [-0.125 * (i + 1) for i in range(len(generated))]
    root = build_root(
        prompt_token_ids=prompt,
        generated_token_ids=generated,
        generated_logprobs=logprobs,
        weight_version=weight_version,
    )
    assert StagedDelta.from_table(StagedDelta.to_table([root])) == [root]
    assert root.recompute_digest() == root.digest


def test_call_record_mirrors_its_delta_and_round_trips():
    child = build_child(build_root())
    record = CallRecord.for_staged(child, staging_segment=SEGMENT, staging_row=3, admitted_at=12.5, epoch_span=True)
    assert (record.digest, record.cum_len, record.parent_call_id) == (child.digest, 8, child.parent_call_id)
    assert CallRecord.from_table(CallRecord.to_table([record])) == [record]
    assert "token" not in " ".join(CallRecord.column_names())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"staging_segment": "/etc/passwd"}, "staging_segment"),
        ({"staging_row": -1}, "staging_row"),
        ({"admitted_at": math.nan}, "admitted_at"),
        ({"epoch_span": 1}, "epoch_span"),
        ({"output_fingerprint": "nope"}, "output_fingerprint"),
        ({"mode": "text"}, "parent_call_id"),
        ({"response_id": ""}, "response_id"),
    ],
)
def test_call_record_invariants(change, match):
    record = CallRecord.for_staged(build_child(build_root()), staging_segment=SEGMENT, staging_row=0, admitted_at=None)
    with pytest.raises((ValueError, TypeError), match=match):
        CallRecord(**(record.to_row() | change))


def test_failure_row_requires_a_named_reason():
    row = FailureRow(
        batch_id="b1",
        rollout_id="r1",
        call_id="r1.a00.c001",
        parent_call_id=None,
        reason="context_length",
        detail="prompt of 9000 tokens exceeds 8192",
    )
    assert FailureRow.from_table(FailureRow.to_table([row])) == [row]
    with pytest.raises(ValueError, match="reason"):
        FailureRow(**(row.to_row() | {"reason": "Context Length!"}))


def ok_receipt(**change) -> Receipt:
    fields = {
        "rollout_id": "r000000-00",
        "group_id": "g000000",
        "attempt": 0,
        "reward": 1.0,
        "reward_info": canonical_json({"answer": "4"}),
        "terminal_call_id": "r000000-00.a00.c001",
        "terminal_selection": "declared",
        "terminal_attribution_reason": "selected",
        "status": "ok",
        "failure_reason": None,
        "num_calls": 2,
    }
    return Receipt(**(fields | change))


def test_receipt_states():
    receipt = ok_receipt()
    assert Receipt.from_table(Receipt.to_table([receipt])) == [receipt]
    poisoned = ok_receipt(
        status="poisoned",
        failure_reason="capture_poisoned",
        terminal_call_id=None,
        terminal_selection=None,
        terminal_attribution_reason=None,
        reward=None,
    )
    assert poisoned.status == "poisoned"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"terminal_call_id": None, "terminal_selection": None}, "no terminal"),
        ({"failure_reason": "engine_error"}, "failure_reason"),
        ({"reward": None}, "reward"),
        ({"reward": math.nan}, "reward"),
        ({"num_calls": 0}, "no calls"),
        ({"status": "poisoned"}, "failure_reason"),
        ({"status": "done"}, "status"),
        ({"terminal_selection": "guess"}, "terminal_selection"),
        ({"terminal_selection": None}, "together"),
        ({"reward_info": "{'a': 1}"}, "reward_info"),
        ({"reward_info": '{"b":1, "a":2}'}, "canonical"),
    ],
)
def test_receipt_invalid_states_are_refused(change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ok_receipt(**change)
