"""Replay: a resumed rollout's committed calls answered from their records (docs/reliability.md, "Resume").

A rollout runs in *episodes*: its first run is episode 0; each time it starts again from its first
turn (a new attempt of its shard, or a failover inside one) a new episode begins, which replays
the calls its last episode committed and goes on live from there. A :class:`ReplayBook` holds
those calls in the order that episode made them (:class:`BookEntry`: the call record, the prompt
tokens it added to its parent's, what the engine answered).

A call matches an entry the book has not answered yet when it continues the same parent with
exactly the same prompt tokens and may sample as many tokens as the entry's answer holds (no more
when the answer stopped at its length). It is then answered from the entry: no engine call,
nothing staged or recorded again. Matching does not depend on the order calls arrive in: concurrent
calls (an agent's sub-agents) each find their own entry. A call that matches none goes to the
engine; when an entry the book has not answered continues the same parent, that call asked for
something else where the earlier episode went on: a divergence, noted in its extras
(``replay_diverged``); the entries it leaves are never part of the rollout's chain.

Invariants: an entry answers at most one call; a match and its undo (the entry's reply could not be
read back as the original attempt read it, so the call goes to the engine) are one operation,
:meth:`ReplayBook.answer`, which holds the entry while the reply is read, so no concurrent call can
take it or have its own match undone.

Every live call of an episode after the first names it in its extras (:meth:`ReplayBook.notes`,
``{"resume": {"episode": e, "replayed": [i, ...]}}``: the indexes of the entries answered so far).
That is what lets a later attempt rebuild the book from storage alone
(:func:`tasks.generate.resume.resume_points`); a count ``m`` instead of a list, as earlier
versions wrote, means the first ``m`` entries.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from tasks.engines.base import GenerationResult
from tasks.records.ledger import CallRecord

REPLAY_DIVERGED = "replay_diverged"  # a live call that asked for something else where an earlier episode went on
RESUME_NOTES = "resume"  # the key of a live call's resume notes in its staged extras
Reply = TypeVar("Reply")


@dataclass(frozen=True)
class BookEntry:
    """A committed call as a replay answers it.

    ``prompt_tokens``: the prompt tokens the call added to its parent's whole sequence (all of the
    prompt for a root); ``carried``: recorded by an earlier attempt (a receipt of this attempt
    lists it in ``replayed_calls``), not among this attempt's own call records.
    """

    record: CallRecord
    prompt_tokens: np.ndarray
    token_ids: tuple[int, ...]
    logprobs: np.ndarray
    text: str
    finish_reason: str
    carried: bool

    def answer(self, prompt: np.ndarray) -> GenerationResult:
        """The engine's answer to ``prompt`` (the call's whole prompt) as the entry recorded it."""
        return GenerationResult(
            request_id=self.record.call_id,
            prompt_token_ids=tuple(prompt.tolist()),
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            text=self.text,
            response_id=self.record.response_id,
        )

    def answers(self, parent_length: int, prompt: np.ndarray, max_tokens: int) -> bool:
        """Whether a call of the same parent on ``prompt`` (``parent_length`` of its tokens are its parent's) with
        ``max_tokens`` to sample asks exactly what this call asked."""
        sampled = len(self.token_ids)
        return (
            self.record.prev_len == parent_length
            and np.array_equal(self.prompt_tokens, prompt[parent_length:])
            and (sampled <= max_tokens if self.finish_reason != "length" else sampled == max_tokens)
        )


class ReplayBook:
    """The committed calls one episode replays, and which of them it answered (see the module docstring)."""

    def __init__(self, entries: Sequence[BookEntry], *, episode: int) -> None:
        self.entries = tuple(entries)
        self.episode = episode
        self._slots: dict[str | None, list[int]] = {}  # parent call id -> its entries, in book order
        for index, entry in enumerate(self.entries):
            self._slots.setdefault(entry.record.parent_call_id, []).append(index)
        self._answered: set[int] = set()
        self._held: set[int] = set()  # taken by a call whose reply is being read back
        self._refused: set[int] = set()  # their reply could not be read back: never answered

    @property
    def replayed(self) -> int:
        """How many entries answered a call."""
        return len(self._answered)

    async def answer(
        self,
        parent_call_id: str | None,
        parent_length: int,
        prompt: np.ndarray,
        max_tokens: int,
        read_back: Callable[[BookEntry], Awaitable[Reply | None]],
    ) -> tuple[BookEntry, Reply] | None:
        """The entry answering a call on ``prompt`` and its reply read back, or None: the call goes to the engine.

        The first matching entry the book has neither answered nor refused is held while ``read_back`` reads
        its reply as the call's caller reads one; a reply it cannot read (None) refuses that entry alone.
        """
        index = next(
            (
                i
                for i in self._slots.get(parent_call_id, ())
                if i not in self._answered | self._held | self._refused
                and self.entries[i].answers(parent_length, prompt, max_tokens)
            ),
            None,
        )
        if index is None:
            return None
        self._held.add(index)
        try:
            reply = await read_back(self.entries[index])
        finally:
            self._held.discard(index)
        if reply is None:
            self._refused.add(index)
            return None
        self._answered.add(index)
        return self.entries[index], reply

    def diverges(self, parent_call_id: str | None) -> bool:
        """Whether a live call continuing ``parent_call_id`` leaves an entry of that parent unanswered."""
        return any(i not in self._answered for i in self._slots.get(parent_call_id, ()))

    def notes(self, *, diverged: bool) -> dict[str, Any]:
        """What a live call of this episode notes in its extras (nothing in episode 0); ``diverged``: it leaves an
        entry of its parent unanswered (:meth:`diverges`)."""
        if self.episode == 0:
            return {}
        notes: dict[str, Any] = {"episode": self.episode, "replayed": sorted(self._answered)}
        if diverged:
            notes["reason"] = REPLAY_DIVERGED
        return notes
