"""The sampling mask's record: CSR kept sets, their invariants and their digest."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from tasks.records.sampling_mask import KEPT_DOMAIN, KeptSets
from tasks.sampling import SamplingSettings, truncates


def test_kept_sets_are_csr_sorted_per_token():
    kept = KeptSets.of([[9, 2, 5], [7]])
    assert kept.counts.tolist() == [3, 1] and kept.token_ids.tolist() == [2, 5, 9, 7]
    assert [s.tolist() for s in kept.sets()] == [[2, 5, 9], [7]]
    assert len(kept) == 2 and kept and not KeptSets.empty()
    kept.check([5, 7])


@pytest.mark.parametrize(
    ("counts", "ids", "sampled", "match"),
    [
        ([1], [4], [4, 5], "1 counts for 2 sampled tokens"),
        ([0, 1], [5], [4, 5], "at least one id"),
        ([2], [4], [4], "add up to 2"),
        ([2], [5, 4], [4], "strictly ascending"),
        ([2], [4, 4], [4], "strictly ascending"),
        ([1], [-1], [4], ">= 0"),
        ([2], [3, 5], [4], "not in its own kept set"),
    ],
)
def test_check_names_the_broken_invariant(counts, ids, sampled, match):
    kept = KeptSets(np.array(counts, np.int32), np.array(ids, np.int32))
    with pytest.raises(ValueError, match=match):
        kept.check(sampled)


def test_a_new_set_may_start_below_the_last_id_of_the_one_before():
    KeptSets(np.array([2, 2], np.int32), np.array([7, 9, 1, 3], np.int32)).check([9, 1])


def test_check_refuses_arrays_of_another_type():
    with pytest.raises(ValueError, match="int32"):
        KeptSets(np.array([1], np.int64), np.array([4], np.int32)).check([4])


def test_ids_past_int32_are_refused():
    with pytest.raises(ValueError, match="must be in"):
        KeptSets.of([[2**31]])


def test_the_digest_is_sha256_of_the_documented_big_endian_encoding():
    kept = KeptSets.of([[2, 5], [7]])
    expected = hashlib.sha256(
        KEPT_DOMAIN + struct.pack(">Q", 2) + struct.pack(">2I", 2, 1) + struct.pack(">3I", 2, 5, 7)
    )
    assert kept.digest() == expected.hexdigest()
    assert KeptSets.of([[2], [5, 7]]).digest() != kept.digest()  # the same ids split otherwise
    assert kept.note() == {"kept_sha256": kept.digest()} and KeptSets.empty().note() == {}


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "expected"),
    [(1.0, 1.0, -1, False), (1.0, 0.9, -1, True), (0.7, 1.0, 50, True), (0.0, 0.9, 50, False), (1e-6, 0.5, 5, False)],
)
def test_truncation_is_top_p_or_top_k_at_a_temperature(temperature, top_p, top_k, expected):
    assert truncates(temperature, top_p, top_k) is expected
    assert SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k).truncates is expected
