"""Digests: the NeMo Gym conformance vector, field coverage, and refusal of input they cannot encode."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.records import digest as dg

GOLDEN_EXTRAS = {"routed_experts": [[[1, 2]], [[3, 4]]]}
GOLDEN_EXTRAS_DIGEST = "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3"
GOLDEN_CALL_DIGEST = "1122c7fe7e914c809eb9b1c09b26d94a50c1eb2790e7430fbcd8363b846ccf27"


def golden_fields() -> dict:
    return {
        "rollout_id": "rollout-1",
        "call_id": "call-1",
        "parent_call_id": "parent-1",
        "mode": "token_in",
        "prev_len": 3,
        "delta_len": 2,
        "cum_len": 5,
        "weight_version": 7,
        "token_ids_delta": [10, 11],
        "token_mask_delta": [0.0, 1.0],
        "logprobs_delta": [0.0, -0.25],
        "extras_digest": GOLDEN_EXTRAS_DIGEST,
        "chain_hash": "11" * 32,
        "cumulative_hash": "22" * 32,
    }


def test_nemo_gym_golden_vector_reproduces():
    assert dg.compute_extras_digest(GOLDEN_EXTRAS) == GOLDEN_EXTRAS_DIGEST
    assert dg.compute_staging_digest(**golden_fields()) == GOLDEN_CALL_DIGEST


def test_golden_vector_accepts_numpy_inputs():
    fields = golden_fields()
    fields["token_ids_delta"] = np.array([10, 11], dtype=np.int64)
    fields["token_mask_delta"] = np.array([0.0, 1.0], dtype=np.float32)
    fields["logprobs_delta"] = np.array([0.0, -0.25], dtype=np.float32)
    assert dg.compute_staging_digest(**fields) == GOLDEN_CALL_DIGEST


def test_digests_are_lowercase_hex():
    for value in (
        dg.compute_staging_digest(**golden_fields()),
        dg.compute_extras_digest(None),
        dg.hash_token_ids([1, 2, 3]),
        dg.chain_hash(None, [1]),
        dg.chain_hash("ab" * 32, [1]),
    ):
        assert len(value) == 64
        assert value == value.lower()
        int(value, 16)


# Every covered field, mutated to another valid value (keeping the section 4.1 rules intact).
FIELD_MUTATIONS = {
    "rollout_id": {"rollout_id": "rollout-2"},
    "call_id": {"call_id": "call-2"},
    "parent_call_id": {"parent_call_id": "parent-2"},
    "mode": {"mode": "text", "parent_call_id": None, "prev_len": 0, "cum_len": 2},
    "prev_len": {"prev_len": 4, "cum_len": 6},
    "delta_len": {
        "delta_len": 3,
        "cum_len": 6,
        "token_ids_delta": [10, 11, 12],
        "token_mask_delta": [0.0, 1.0, 1.0],
        "logprobs_delta": [0.0, -0.25, -1.0],
    },
    "cum_len": {"prev_len": 2, "cum_len": 4},
    "weight_version": {"weight_version": 8},
    "token_ids_delta": {"token_ids_delta": [10, 12]},
    "token_mask_delta": {"token_mask_delta": [1.0, 1.0]},
    "logprobs_delta": {"logprobs_delta": [0.0, -0.5]},
    "extras_digest": {"extras_digest": dg.compute_extras_digest(None)},
    "chain_hash": {"chain_hash": "33" * 32},
    "chain_hash_absent": {"chain_hash": None},
    "cumulative_hash": {"cumulative_hash": "44" * 32},
    "cumulative_hash_absent": {"cumulative_hash": None},
}


@pytest.mark.parametrize("name", sorted(FIELD_MUTATIONS))
def test_every_covered_field_changes_the_digest(name):
    fields = golden_fields() | FIELD_MUTATIONS[name]
    assert dg.compute_staging_digest(**fields) != GOLDEN_CALL_DIGEST


def test_uncovered_inputs_cannot_be_passed():
    with pytest.raises(TypeError):
        dg.compute_staging_digest(**golden_fields(), batch_id="b")  # type: ignore[call-arg]


small_ids = st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=8)


@st.composite
def call_fields(draw):
    is_root = draw(st.booleans())
    n = draw(st.integers(1, 6))
    carry = draw(st.integers(0, n))
    prev_len = 0 if is_root else draw(st.integers(1, 1000))
    logprobs = draw(st.lists(st.floats(-50, 0, width=32), min_size=n - carry, max_size=n - carry))
    return {
        "rollout_id": draw(st.from_regex(r"[a-z0-9][a-z0-9.-]{0,10}", fullmatch=True)),
        "call_id": draw(st.from_regex(r"[a-z0-9][a-z0-9.-]{0,10}", fullmatch=True)),
        "parent_call_id": None if is_root else "p",
        "mode": "text" if is_root else "token_in",
        "prev_len": prev_len,
        "delta_len": n,
        "cum_len": prev_len + n,
        "weight_version": draw(st.integers(0, 2**64 - 1)),
        "token_ids_delta": draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)),
        "token_mask_delta": [0.0] * carry + [1.0] * (n - carry),
        "logprobs_delta": [0.0] * carry + logprobs,
        "extras_digest": dg.compute_extras_digest(draw(st.integers(-(2**63), 2**63 - 1))),
        "chain_hash": draw(st.none() | st.just("ab" * 32)),
        "cumulative_hash": draw(st.none() | st.just("cd" * 32)),
    }


@settings(max_examples=200)
@given(call_fields(), st.data())
def test_changing_any_list_element_changes_the_digest(fields, data):
    base = dg.compute_staging_digest(**fields)
    ids = list(fields["token_ids_delta"])
    i = data.draw(st.integers(0, len(ids) - 1))
    ids[i] = (ids[i] + data.draw(st.integers(1, 1000))) % 2**64
    assert dg.compute_staging_digest(**(fields | {"token_ids_delta": ids})) != base
    logprobs = list(fields["logprobs_delta"])
    sampled = [j for j, m in enumerate(fields["token_mask_delta"]) if m == 1.0]
    if sampled:
        j = data.draw(st.sampled_from(sampled))
        logprobs[j] = float(np.nextafter(np.float32(logprobs[j]), np.float32(-np.inf)))
        assert dg.compute_staging_digest(**(fields | {"logprobs_delta": logprobs})) != base


@given(call_fields())
def test_digest_is_deterministic_and_input_type_agnostic(fields):
    as_numpy = fields | {
        "token_ids_delta": np.array(fields["token_ids_delta"], dtype=np.uint64),
        "token_mask_delta": np.array(fields["token_mask_delta"], dtype=np.float32),
        "logprobs_delta": np.array(fields["logprobs_delta"], dtype=np.float32),
    }
    assert dg.compute_staging_digest(**fields) == dg.compute_staging_digest(**as_numpy)


@pytest.mark.parametrize(
    ("override", "error", "field"),
    [
        ({"logprobs_delta": [0.0, math.nan]}, ValueError, "logprobs_delta"),
        ({"logprobs_delta": [0.0, -math.inf]}, ValueError, "logprobs_delta"),
        ({"logprobs_delta": [0.0, -1e39]}, ValueError, "logprobs_delta"),
        ({"token_mask_delta": [0.0, math.inf]}, ValueError, "token_mask_delta"),
        ({"token_ids_delta": [10, -1]}, ValueError, "token_ids_delta"),
        ({"token_ids_delta": [10, 2**64]}, ValueError, "token_ids_delta"),
        ({"token_ids_delta": [10.0, 11.0]}, TypeError, "token_ids_delta"),
        ({"token_ids_delta": [True, 11]}, TypeError, "token_ids_delta"),
        ({"token_mask_delta": ["0", "1"]}, TypeError, "token_mask_delta"),
        ({"schema_version": 3}, ValueError, "schema_version"),
        ({"digest_version": 1}, ValueError, "digest_version"),
        ({"extras_digest_version": 2}, ValueError, "extras_digest_version"),
        ({"extras_digest": "zz" * 32}, ValueError, "extras_digest"),
        ({"extras_digest": "AB" * 32}, ValueError, "extras_digest"),
        ({"chain_hash": "11" * 31}, ValueError, "chain_hash"),
        ({"cumulative_hash": b"\x22" * 32}, TypeError, "cumulative_hash"),
        ({"prev_len": -1}, ValueError, "prev_len"),
        ({"weight_version": 2**64}, ValueError, "weight_version"),
        ({"weight_version": 1.0}, TypeError, "weight_version"),
        ({"token_mask_delta": [0.0, 1.0, 1.0]}, ValueError, "token_mask_delta"),
        ({"rollout_id": ""}, ValueError, "rollout_id"),
        ({"call_id": 5}, TypeError, "call_id"),
    ],
)
def test_bad_inputs_are_refused_naming_the_field(override, error, field):
    with pytest.raises(error, match=field):
        dg.compute_staging_digest(**(golden_fields() | override))


@pytest.mark.parametrize(
    ("extras", "error"),
    [
        ({"x": math.nan}, ValueError),
        ({"x": math.inf}, ValueError),
        ((1, 2), TypeError),
        (b"raw", TypeError),
        (np.int64(3), TypeError),
        (np.float32(1.0), TypeError),
        ({1: "a"}, TypeError),
        ({"x": [1, {"y": (1,)}]}, TypeError),
        (2**63, ValueError),
    ],
)
def test_extras_refuses_values_json_cannot_round_trip(extras, error):
    with pytest.raises(error, match="extras"):
        dg.compute_extras_digest(extras)


def test_extras_encoding_distinguishes_types_and_sorts_keys_by_utf8():
    assert dg.compute_extras_digest(1) != dg.compute_extras_digest(1.0)
    assert dg.compute_extras_digest(True) != dg.compute_extras_digest(1)
    assert dg.compute_extras_digest(None) != dg.compute_extras_digest([])
    assert dg.compute_extras_digest({"b": 1, "a": 2}) == dg.compute_extras_digest({"a": 2, "b": 1})
    assert dg.compute_extras_digest("ab") != dg.compute_extras_digest(["a", "b"])


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=10,
)


@given(json_values)
def test_extras_digest_survives_a_canonical_json_round_trip(value):
    import json

    from tasks.records.ledger import canonical_json

    assert dg.compute_extras_digest(json.loads(canonical_json(value))) == dg.compute_extras_digest(value)


def test_cumulative_and_chain_hashes():
    assert dg.hash_token_ids([1, 2]) != dg.hash_token_ids([1, 2, 0])
    assert dg.hash_token_ids([]) == dg.hash_token_ids(np.zeros(0, dtype=np.int64))
    root = dg.chain_hash(None, [1, 2])
    assert dg.chain_hash(root, [3]) != dg.chain_hash(None, [3])
    assert dg.chain_hash(root, [3]) != dg.chain_hash(dg.chain_hash(None, [1]), [3])
    with pytest.raises(ValueError, match="parent_chain_hash"):
        dg.chain_hash("xyz", [1])
    with pytest.raises(ValueError, match="delta_ids"):
        dg.chain_hash(None, [-1])
