"""Batched digests equal the per-row digests of tasks.records.digest, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.records import digest as dg
from tasks.records import digest_batch as db

HEX = st.binary(min_size=32, max_size=32).map(bytes.hex)
TEXT = st.text(min_size=1, max_size=12)


@st.composite
def rows(draw: st.DrawFn) -> tuple[list[dict], db.FlatTokens, list[np.ndarray]]:
    """Random rows (some empty) with their flat tokens; each row's arrays kept for the reference digests."""
    count = draw(st.integers(1, 6))
    scalars, arrays = [], []
    for _ in range(count):
        n = draw(st.integers(0, 9))
        ids = np.array(draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)), dtype=np.uint64)
        floats = st.floats(allow_nan=False, allow_infinity=False, width=32)
        mask = np.array(draw(st.lists(floats, min_size=n, max_size=n)), dtype=np.float32)
        logprobs = np.array(draw(st.lists(floats, min_size=n, max_size=n)), dtype=np.float32)
        arrays.append((ids, mask, logprobs))
        scalars.append(
            {
                "rollout_id": draw(TEXT),
                "call_id": draw(TEXT),
                "parent_call_id": draw(st.none() | TEXT),
                "mode": draw(TEXT),
                "prev_len": draw(st.integers(0, 2**64 - 1)),
                "delta_len": draw(st.integers(0, 2**64 - 1)),
                "cum_len": draw(st.integers(0, 2**64 - 1)),
                "weight_version": draw(st.integers(0, 2**64 - 1)),
                "extras_digest": draw(HEX),
                "chain_hash": draw(st.none() | HEX),
                "cumulative_hash": draw(st.none() | HEX),
            }
        )
    starts = np.concatenate([[0], np.cumsum([a[0].size for a in arrays])]).astype(np.int64)
    tokens = db.FlatTokens.of(
        np.concatenate([a[0] for a in arrays]),
        np.concatenate([a[1] for a in arrays]),
        np.concatenate([a[2] for a in arrays]),
        starts,
    )
    return scalars, tokens, arrays


def columns(scalars: list[dict]) -> dict[str, list]:
    return {name: [row[name] for row in scalars] for name in db.CALL_DIGEST_FIELDS}


@settings(max_examples=60, deadline=None)
@given(rows())
def test_call_digests_equal_digest_of_checked_call(drawn: tuple) -> None:
    scalars, tokens, arrays = drawn
    expected = [
        dg.digest_of_checked_call(**row, ids=ids, mask=mask, logprobs=logprobs)
        for row, (ids, mask, logprobs) in zip(scalars, arrays, strict=True)
    ]
    assert db.call_digests(tokens, columns(scalars), range(len(scalars))) == expected


@settings(max_examples=60, deadline=None)
@given(rows(), st.data())
def test_chain_hashes_equal_chain_hash_of_checked(drawn: tuple, data: st.DataObject) -> None:
    _, tokens, arrays = drawn
    parents = data.draw(st.lists(st.none() | HEX, min_size=len(arrays), max_size=len(arrays)))
    expected = [dg.chain_hash_of_checked(p, a[0]) for p, a in zip(parents, arrays, strict=True)]
    assert db.chain_hashes(tokens, parents, range(len(arrays))) == expected


@settings(max_examples=60, deadline=None)
@given(rows(), st.data())
def test_cumulative_hash_of_a_row_range_equals_hash_token_ids(drawn: tuple, data: st.DataObject) -> None:
    _, tokens, arrays = drawn
    first = data.draw(st.integers(0, len(arrays)))
    end = data.draw(st.integers(first, len(arrays)))
    joined = np.concatenate([np.zeros(0, np.uint64)] + [a[0] for a in arrays[first:end]])
    assert db.cumulative_hash(tokens, first, end) == dg.hash_token_ids(joined)


def test_a_subset_of_rows_is_digested_in_the_order_asked() -> None:
    scalars = [
        {**dict.fromkeys(("rollout_id", "call_id", "mode"), "x"), "parent_call_id": None}
        | dict.fromkeys(("prev_len", "delta_len", "cum_len", "weight_version"), 1)
        | {"extras_digest": "ab" * 32, "chain_hash": None, "cumulative_hash": "cd" * 32}
        for _ in range(3)
    ]
    ids = np.array([5, 6, 7], np.uint64)
    mask = np.array([0, 1, 1], np.float32)
    tokens = db.FlatTokens.of(ids, mask, -mask, np.array([0, 1, 2, 3]))
    digests = db.call_digests(tokens, columns(scalars), [2, 0])
    assert digests == [
        dg.digest_of_checked_call(**scalars[i], ids=ids[i : i + 1], mask=mask[i : i + 1], logprobs=-mask[i : i + 1])
        for i in (2, 0)
    ]


def test_flat_tokens_refuse_lists_of_unequal_length() -> None:
    with pytest.raises(ValueError, match="flat lists"):
        db.FlatTokens.of(np.zeros(2, np.uint64), np.zeros(2, np.float32), np.zeros(1, np.float32), np.array([0, 2]))
