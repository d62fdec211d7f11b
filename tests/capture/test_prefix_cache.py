"""ChainPrefixCache and admission resolution (docs/architecture.md §5, steps 1-2)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.capture.prefix_cache import (
    Admission,
    AdmissionError,
    ChainPrefixCache,
    PrefixMismatchError,
    resolve_admission,
)

HASH = "ab" * 32


class FakeStagingFetcher:
    """Stands in for staging reads: deltas by staging key, recording every bulk fetch."""

    def __init__(self, deltas: dict[str, list[int]]) -> None:
        self.deltas = deltas
        self.calls: list[list[str]] = []

    def __call__(self, keys: Sequence[str]) -> list[np.ndarray]:
        self.calls.append(list(keys))
        return [np.asarray(self.deltas[key], dtype=np.int64) for key in keys]

    @property
    def fetched_keys(self) -> list[str]:
        return [key for call in self.calls for key in call]


def _chain(rollout: str, turns: int) -> tuple[list[str], dict[str, list[int]]]:
    keys = [f"{rollout}/{rollout}.a00.c{i:03d}" for i in range(turns)]
    return keys, {key: [100 * i + j for j in range(i + 2)] for i, key in enumerate(keys)}


def _expected(keys: Sequence[str], deltas: dict[str, list[int]]) -> list[int]:
    return [token for key in keys for token in deltas[key]]


def test_first_lookup_fetches_the_whole_chain_in_one_bulk_call() -> None:
    keys, deltas = _chain("r0", 3)
    fetch = FakeStagingFetcher(deltas)
    cache = ChainPrefixCache(fetch, source_id="batch-a")

    prefix = cache.get_prefix(keys)

    assert prefix.tolist() == _expected(keys, deltas)
    assert prefix.dtype == np.int64
    assert fetch.calls == [keys]


def test_next_turn_reads_only_the_uncached_suffix() -> None:
    keys, deltas = _chain("r0", 5)
    fetch = FakeStagingFetcher(deltas)
    cache = ChainPrefixCache(fetch, source_id="batch-a")
    cache.get_prefix(keys[:2])

    prefix = cache.get_prefix(keys)

    assert prefix.tolist() == _expected(keys, deltas)
    assert fetch.calls == [keys[:2], keys[2:]]


def test_fully_cached_chain_is_served_without_fetching() -> None:
    keys, deltas = _chain("r0", 3)
    fetch = FakeStagingFetcher(deltas)
    cache = ChainPrefixCache(fetch, source_id="batch-a")
    first = cache.get_prefix(keys)

    again = cache.get_prefix(keys)

    assert again is first
    assert len(fetch.calls) == 1


def test_longest_cached_prefix_wins_over_a_shorter_one() -> None:
    keys, deltas = _chain("r0", 6)
    fetch = FakeStagingFetcher(deltas)
    cache = ChainPrefixCache(fetch, source_id="batch-a")
    cache.get_prefix(keys[:1])
    cache.get_prefix(keys[:4])
    fetch.calls.clear()

    assert cache.get_prefix(keys).tolist() == _expected(keys, deltas)
    assert fetch.calls == [keys[4:]]


def test_sibling_branches_share_the_cached_parent_prefix() -> None:
    keys, deltas = _chain("r0", 3)
    retry = "r0/r0.a00.c009"
    deltas[retry] = [7, 7]
    fetch = FakeStagingFetcher(deltas)
    cache = ChainPrefixCache(fetch, source_id="batch-a")
    cache.get_prefix(keys[:2])

    assert cache.get_prefix([*keys[:2], retry]).tolist() == [*_expected(keys[:2], deltas), 7, 7]
    assert cache.get_prefix(keys).tolist() == _expected(keys, deltas)
    assert fetch.calls[1:] == [[retry], [keys[2]]]


def test_oldest_insertion_is_evicted_even_when_it_was_just_read() -> None:
    keys, deltas = _chain("r0", 4)
    fetch = FakeStagingFetcher(deltas)
    cache = ChainPrefixCache(fetch, source_id="batch-a", max_entries=2)
    cache.get_prefix(keys[:1])
    cache.get_prefix(keys[:2])
    cache.get_prefix(keys[:1])  # a hit does not refresh: eviction is by insertion, not LRU
    cache.get_prefix(keys[:3])

    assert len(cache) == 2
    assert keys[0] not in cache
    assert keys[1] in cache
    assert keys[2] in cache


def test_default_capacity_is_256_entries() -> None:
    deltas = {f"r{i}/c0": [i] for i in range(300)}
    fetch = FakeStagingFetcher(deltas)
    cache = ChainPrefixCache(fetch, source_id="batch-a")
    for key in deltas:
        cache.get_prefix([key])
    assert len(cache) == 256
    assert "r43/c0" not in cache
    assert "r44/c0" in cache


def test_changing_the_source_clears_the_cache() -> None:
    keys, deltas = _chain("r0", 2)
    old, new = FakeStagingFetcher(deltas), FakeStagingFetcher({k: [1] for k in keys})
    cache = ChainPrefixCache(old, source_id="batch-a")
    cache.get_prefix(keys)

    cache.set_source("batch-b", new)

    assert len(cache) == 0
    assert cache.get_prefix(keys).tolist() == [1, 1]
    assert new.calls == [keys]


def test_setting_the_same_source_again_keeps_the_cache() -> None:
    keys, deltas = _chain("r0", 2)
    fetch = FakeStagingFetcher(deltas)
    cache = ChainPrefixCache(fetch, source_id="batch-a")
    cache.get_prefix(keys)

    cache.set_source("batch-a", fetch)

    assert keys[-1] in cache
    assert len(fetch.calls) == 1


def test_fetch_racing_a_source_change_is_not_cached() -> None:
    keys, deltas = _chain("r0", 2)
    cache = ChainPrefixCache(source_id="batch-a")

    def fetch_then_switch(batch: Sequence[str]) -> list[np.ndarray]:
        cache.set_source("batch-b", FakeStagingFetcher(deltas))
        return [np.asarray(deltas[key]) for key in batch]

    cache.set_source("batch-a", fetch_then_switch)
    cache.get_prefix(keys)
    assert len(cache) == 0


def test_returned_prefix_is_read_only() -> None:
    keys, deltas = _chain("r0", 2)
    prefix = ChainPrefixCache(FakeStagingFetcher(deltas), source_id="s").get_prefix(keys)
    with pytest.raises(ValueError, match="read-only"):
        prefix[0] = 5


def test_empty_chain_is_an_empty_prefix_without_fetching() -> None:
    fetch = FakeStagingFetcher({})
    assert ChainPrefixCache(fetch, source_id="s").get_prefix([]).size == 0
    assert fetch.calls == []


def test_chain_repeating_a_key_is_refused() -> None:
    keys, deltas = _chain("r0", 2)
    with pytest.raises(ValueError, match="repeats a key"):
        ChainPrefixCache(FakeStagingFetcher(deltas), source_id="s").get_prefix([*keys, keys[0]])


def test_fetcher_returning_the_wrong_number_of_deltas_is_refused() -> None:
    cache = ChainPrefixCache(lambda keys: [np.array([1])], source_id="s")
    with pytest.raises(ValueError, match="returned 1 deltas for 2 staging keys"):
        cache.get_prefix(["r0/c0", "r0/c1"])


def test_non_integer_delta_is_refused_naming_its_key() -> None:
    cache = ChainPrefixCache(lambda keys: [np.array([1.5])], source_id="s")
    with pytest.raises(ValueError, match="delta of r0/c0"):
        cache.get_prefix(["r0/c0"])


def test_cache_without_a_source_refuses_to_fetch() -> None:
    with pytest.raises(RuntimeError, match="no source"):
        ChainPrefixCache().get_prefix(["r0/c0"])


@given(
    turns=st.integers(min_value=1, max_value=12),
    lookups=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=10),
    capacity=st.integers(min_value=1, max_value=4),
)
def test_property_prefix_is_always_the_concatenated_chain(turns: int, lookups: list[int], capacity: int) -> None:
    keys, deltas = _chain("r0", turns)
    fetch = FakeStagingFetcher(deltas)
    cache = ChainPrefixCache(fetch, source_id="s", max_entries=capacity)
    for length in lookups:
        chain = keys[: min(length, turns)]
        before = len(fetch.calls)
        assert cache.get_prefix(chain).tolist() == _expected(chain, deltas)
        assert len(fetch.calls) - before <= 1  # at most one bulk read per lookup
        assert len(cache) <= capacity
    assert all(call == keys[keys.index(call[0]) : keys.index(call[0]) + len(call)] for call in fetch.calls)


# --- admission ----------------------------------------------------------------------------


def _child(prev_len: int, chain: Sequence[str], parent: str = "r0.a00.c001") -> Admission:
    return Admission(
        "r0.a00.c002", parent_call_id=parent, prev_len=prev_len, staging_chain=tuple(chain), parent_chain_hash=HASH
    )


def test_root_admission_resolves_to_no_tokens_without_fetching() -> None:
    fetch = FakeStagingFetcher({})
    prefix = resolve_admission(Admission("r0.a00.c000"), ChainPrefixCache(fetch, source_id="s"))
    assert prefix.size == 0
    assert fetch.calls == []


def test_child_admission_resolves_to_its_parents_exact_tokens() -> None:
    keys, deltas = _chain("r0", 2)
    cache = ChainPrefixCache(FakeStagingFetcher(deltas), source_id="s")
    expected = _expected(keys, deltas)
    assert resolve_admission(_child(len(expected), keys), cache).tolist() == expected


def test_prefix_of_the_wrong_length_is_a_prefix_mismatch_naming_call_and_lengths() -> None:
    keys, deltas = _chain("r0", 2)
    cache = ChainPrefixCache(FakeStagingFetcher(deltas), source_id="s")
    with pytest.raises(PrefixMismatchError, match=r"r0\.a00\.c002.* 5 tokens.*prev_len 9") as info:
        resolve_admission(_child(9, keys), cache)
    assert info.value.reason == "prefix_mismatch"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prev_len": 3}, "must have prev_len 0"),
        ({"staging_chain": ("r0/r0.a00.c000",)}, "empty staging chain"),
        ({"parent_chain_hash": HASH}, "no parent chain hash"),
    ],
)
def test_root_admission_with_child_fields_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(AdmissionError, match=message) as info:
        Admission("r0.a00.c000", **fields)
    assert info.value.reason == "invalid_admission"


def test_child_admission_with_zero_prev_len_is_refused() -> None:
    with pytest.raises(AdmissionError, match="prev_len > 0"):
        _child(0, ["r0/r0.a00.c001"])


def test_child_admission_whose_chain_does_not_end_at_its_parent_is_refused() -> None:
    with pytest.raises(AdmissionError, match=r"must end at parent r0\.a00\.c001"):
        _child(4, ["r0/r0.a00.c001", "r0/r0.a00.c007"])
    with pytest.raises(AdmissionError, match="must end at parent"):
        _child(4, [])


def test_child_admission_without_parent_chain_hash_is_refused() -> None:
    with pytest.raises(AdmissionError, match="no parent chain hash"):
        Admission("r0.a00.c002", parent_call_id="r0.a00.c001", prev_len=4, staging_chain=("r0/r0.a00.c001",))


def test_admission_with_a_malformed_staging_key_is_refused() -> None:
    with pytest.raises(AdmissionError, match="staging_chain"):
        _child(4, ["../etc/r0.a00.c001"])


def test_admission_chain_given_as_a_list_is_stored_as_a_tuple() -> None:
    admission = Admission(
        "r0.a00.c002",
        parent_call_id="r0.a00.c001",
        prev_len=4,
        staging_chain=["r0/r0.a00.c001"],  # type: ignore[arg-type]
        parent_chain_hash=HASH,
    )
    assert admission.staging_chain == ("r0/r0.a00.c001",)
