"""Identifier rules: no path traversal or separators through ids; deterministic ids."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks import ids


@pytest.mark.parametrize("good", ["a", "r000012-03.a01.c004", "Batch_2026-11-29", "x" * 128])
def test_valid_ids_pass(good):
    assert ids.check_id(good, field="batch_id") == good


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", ".hidden", "-x", "_x", "a b", "é", "x" * 129, "a\nb", "a\\b"])
def test_invalid_ids_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="batch_id"):
        ids.check_id(bad, field="batch_id")


def test_non_string_ids_are_refused():
    with pytest.raises(TypeError, match="rollout_id"):
        ids.check_id(12, field="rollout_id")


def test_deterministic_ids():
    assert ids.rollout_id(12, 3) == "r000012-03"
    assert ids.group_id(12) == "g000012"
    assert ids.call_id("r000012-03", 1, 4) == "r000012-03.a01.c004"
    assert ids.staging_key("r1", "r1.a00.c000") == "r1/r1.a00.c000"
    assert ids.shard_name(7) == "shard-00007"
    assert ids.attempt_name(2) == "attempt-02"


@pytest.mark.parametrize("bad", [-1, True, 1.0, "1"])
def test_indices_must_be_non_negative_ints(bad):
    with pytest.raises(ValueError, match="task_index"):
        ids.rollout_id(bad, 0)


@given(st.integers(0, 10**6), st.integers(0, 99), st.integers(0, 99), st.integers(0, 999))
def test_generated_ids_are_valid_and_distinct_per_ordinal(task, sample, attempt, ordinal):
    rollout = ids.rollout_id(task, sample)
    first = ids.call_id(rollout, attempt, ordinal)
    assert ids.check_id(first, field="call_id") == first
    assert first != ids.call_id(rollout, attempt, ordinal + 1)
    assert first != ids.call_id(rollout, attempt + 1, ordinal)
