"""The replay book and the manifest a rollout builds: order-free matching, one-operation undo, carried before own."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from tasks.capture.replay import REPLAY_DIVERGED, BookEntry, ReplayBook
from tasks.capture.rollout import CallManifest, RolloutCapture
from tasks.records.ledger import CallRecord


def record(call_id: str, parent: str | None = None, prev_len: int = 0) -> CallRecord:
    """A FAKE call record: the book and the manifest read only a record's id, parent and parent length."""
    return SimpleNamespace(call_id=call_id, parent_call_id=parent, prev_len=prev_len)  # type: ignore[return-value]


def entry(call_id: str, prompt: list[int], parent: str | None = None, prev_len: int = 0) -> BookEntry:
    return BookEntry(
        record=record(call_id, parent, prev_len),
        prompt_tokens=np.asarray(prompt, np.int64),
        token_ids=(7, 8),
        logprobs=np.zeros(2, np.float32),
        text="ok",
        finish_reason="stop",
        carried=True,
    )


async def read_back(entry: BookEntry) -> str:
    return entry.record.call_id


def test_concurrent_calls_find_their_own_entries_whatever_order_they_arrive_in():
    book = ReplayBook([entry("a0", [1, 2]), entry("b0", [3, 4]), entry("a1", [5], "a0", 4)], episode=1)

    async def both() -> list:
        return await asyncio.gather(
            book.answer(None, 0, np.array([3, 4]), 16, read_back),  # b0 first, although the book holds a0 first
            book.answer(None, 0, np.array([1, 2]), 16, read_back),
        )

    b0, a0 = asyncio.run(both())
    assert (b0[0].record.call_id, a0[0].record.call_id) == ("b0", "a0") and book.replayed == 2
    assert asyncio.run(book.answer(None, 0, np.array([3, 4]), 16, read_back)) is None  # an entry answers once
    assert book.notes(diverged=False) == {"episode": 1, "replayed": [0, 1]}


def test_a_match_and_its_undo_are_one_operation_safe_under_concurrent_calls():
    """Two concurrent calls ask the same prompt; the first's reply is refused while the second's is being read: the
    refusal undoes the first's entry alone, never the other's."""
    book = ReplayBook([entry("x0", [1]), entry("x1", [1])], episode=1)
    refuse_first = asyncio.Event()

    async def slow_refusal(entry: BookEntry) -> str | None:
        await refuse_first.wait()
        return None

    async def both() -> tuple:
        first = asyncio.ensure_future(book.answer(None, 0, np.array([1]), 16, slow_refusal))
        await asyncio.sleep(0)  # the first holds x0 while its reply is read
        second = await book.answer(None, 0, np.array([1]), 16, read_back)
        refuse_first.set()
        return await first, second

    first, second = asyncio.run(both())
    assert first is None and second[0].record.call_id == "x1"
    assert book.replayed == 1 and book.notes(diverged=False)["replayed"] == [1]
    assert asyncio.run(book.answer(None, 0, np.array([1]), 16, read_back)) is None  # x0 stays refused


def test_a_live_call_diverges_only_where_it_leaves_an_entry_of_its_parent_unanswered():
    book = ReplayBook([entry("a0", [1]), entry("a1", [2], "a0", 1)], episode=2)
    asyncio.run(book.answer(None, 0, np.array([1]), 16, read_back))
    assert book.diverges("a0") and not book.diverges("a1")  # a live call after a1 goes on where the book ended
    assert book.notes(diverged=True) == {"episode": 2, "replayed": [0], "reason": REPLAY_DIVERGED}
    assert ReplayBook([], episode=0).notes(diverged=False) == {}


def test_a_longer_budget_or_another_prompt_is_no_match():
    cut = BookEntry(record("c0"), np.asarray([1]), (5,) * 4, np.zeros(4, np.float32), "", "length", True)
    book = ReplayBook([cut], episode=1)
    assert asyncio.run(book.answer(None, 0, np.array([1]), 8, read_back)) is None  # it stopped at its length 4
    assert asyncio.run(book.answer(None, 0, np.array([2]), 4, read_back)) is None
    assert asyncio.run(book.answer(None, 0, np.array([1]), 4, read_back)) is not None


def test_carried_calls_come_before_own_calls_whatever_order_concurrent_calls_recorded_them():
    """The invariant named in the issue: a rollout's manifest lists the calls of earlier attempts it replayed, then
    this attempt's own, even when concurrent agent calls interleave replays and live calls."""
    manifest = CallManifest()
    manifest.record(record("r.a01.c000"))  # a live call of one sub-agent...
    assert manifest.carry(record("r.a00.c000"))  # ...then another sub-agent's replay
    manifest.record(record("r.a01.c001"))
    assert manifest.carry(record("r.a00.c001")) and not manifest.carry(record("r.a00.c000"))  # once each
    assert [r.call_id for r in manifest.records] == ["r.a00.c000", "r.a00.c001", "r.a01.c000", "r.a01.c001"]
    assert manifest.carried_ids == ["r.a00.c000", "r.a00.c001"]


def test_a_calls_seed_follows_its_prompt_and_repeats_not_its_arrival():
    one, other = (RolloutCapture(batch_id="b", rollout_id="r", attempt=0, seed=5) for _ in range(2))
    a, b = np.array([1, 2, 3]), np.array([4, 5])
    first = [one.seed_for(a), one.seed_for(b), one.seed_for(a)]
    second = [other.seed_for(b), other.seed_for(a), other.seed_for(a)]  # arrival order swapped
    assert (first[0], first[1], first[2]) == (second[1], second[0], second[2])
    assert first[0] != first[2]  # the same prompt asked again (a retry) gets a seed of its own
    other.begin_episode([], 1)
    assert other.seed_for(a) == first[0]  # a new episode asks again from the start


@pytest.mark.parametrize("episode", [1, 3])
def test_a_resumed_episode_notes_the_entries_it_answered(episode):
    book = ReplayBook([entry("a0", [1]), entry("b0", [2])], episode=episode)
    asyncio.run(book.answer(None, 0, np.array([2]), 16, read_back))
    assert book.notes(diverged=False) == {"episode": episode, "replayed": [1]}
