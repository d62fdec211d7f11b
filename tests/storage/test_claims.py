"""Claims of the next free number: create-once, a lost race moves on, a lost answer keeps the writer's number."""

from __future__ import annotations

import pytest

from tasks.storage.claims import MAX_CLAIM_RACES, claim_next
from tasks.storage.objects import ObjectStore


def claim_of(writer: str):
    return lambda number: (f"runs/run-{number:03d}/_CLAIM.json", f'{{"writer": "{writer}"}}'.encode())


def test_a_claim_taken_by_another_writer_moves_to_the_next_number(store: ObjectStore) -> None:
    assert claim_next(store, 0, claim_of("a"), what="a test run") == 0
    assert claim_next(store, 0, claim_of("b"), what="a test run") == 1
    assert store.read_bytes("runs/run-001/_CLAIM.json") == b'{"writer": "b"}'


def test_a_claim_whose_write_answer_was_lost_stays_the_writers_own(store: ObjectStore) -> None:
    """The storage retry repeats a write that had reached storage: the identical bytes are this writer's claim."""
    path, data = claim_of("a")(3)
    store.write_once(path, data)  # the first try, whose answer never came back
    assert claim_next(store, 3, claim_of("a"), what="a test run") == 3


def test_endless_lost_races_are_an_error_naming_what(tmp_path) -> None:
    store = ObjectStore(str(tmp_path))
    for number in range(MAX_CLAIM_RACES):
        store.write_once(*claim_of("other")(number))
    with pytest.raises(RuntimeError, match=f"lost {MAX_CLAIM_RACES} claim races for a test run"):
        claim_next(store, 0, claim_of("me"), what="a test run")
