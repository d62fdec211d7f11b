"""Replay: a resumed rollout's committed calls answered from their records (docs/reliability.md, "Resume").

A rollout runs in *episodes*: its first run is episode 0; each time it starts again from its first
turn (a new attempt of its shard, or a failover inside one) a new episode begins, which replays
the calls its last episode committed and goes on live from there. A :class:`ReplayBook` holds
those calls in the order that episode made them (:class:`BookEntry`: the call record, the prompt
tokens it added to its parent's, what the engine answered).

A call matches the book's next entry when it continues the same parent with exactly the same
prompt tokens, and may sample as many tokens as the entry's answer holds (no more when the answer
stopped at its length). It is then answered from the entry: no engine call, nothing staged or
recorded again. The first call that does not match closes the book: it and every later call of
the episode go to the engine, the first with ``replay_diverged`` in its extras when entries were
left (they are never part of the rollout's chain). Invariant: the calls an episode replays are the
first entries of its book, in order.

Every live call of an episode after the first names it in its extras (:meth:`ReplayBook.notes`,
``{"resume": {"episode": e, "replayed": m}}``): how many entries it replayed. That is what lets a
later attempt rebuild the book from storage alone (:func:`tasks.generate.resume.resume_points`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.engines.base import GenerationResult
from tasks.records.ledger import CallRecord

REPLAY_DIVERGED = "replay_diverged"  # the first live call of an episode that asked for something else
RESUME_NOTES = "resume"  # the key of a live call's resume notes in its staged extras


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


class ReplayBook:
    """The committed calls one episode replays, in order, and how far it got (see the module docstring)."""

    def __init__(self, entries: Sequence[BookEntry], *, episode: int) -> None:
        self.entries = tuple(entries)
        self.episode = episode
        self.replayed = 0  # entries answered so far
        self.closed = not self.entries  # no entry will be answered again
        self.diverged = False  # closed by a call that asked for something else, entries left
        self._divergence_noted = False

    def match(
        self, parent_call_id: str | None, parent_length: int, prompt: np.ndarray, max_tokens: int
    ) -> BookEntry | None:
        """The entry answering a call on ``prompt`` (``parent_length`` of its tokens are its parent's),
        or None: the call goes to the engine, and the book is closed."""
        if self.closed:
            return None
        entry = self.entries[self.replayed]
        sampled = len(entry.token_ids)
        if (
            entry.record.parent_call_id == parent_call_id
            and entry.record.prev_len == parent_length
            and np.array_equal(entry.prompt_tokens, prompt[parent_length:])
            and (sampled <= max_tokens if entry.finish_reason != "length" else sampled == max_tokens)
        ):
            self.replayed += 1
            self.closed = self.replayed == len(self.entries)
            return entry
        self.closed = self.diverged = True
        return None

    def close(self) -> None:
        """Undo the last match and answer nothing more: its call goes to the engine, as a divergence
        (its reply could not be read back as the original attempt read it)."""
        self.replayed -= 1
        self.closed = self.diverged = True

    def notes(self) -> dict[str, Any]:
        """What a live call of this episode notes in its extras (nothing in episode 0); the first after a
        divergence names it."""
        if self.episode == 0:
            return {}
        notes: dict[str, Any] = {"episode": self.episode, "replayed": self.replayed}
        if self.diverged and not self._divergence_noted:
            self._divergence_noted = True
            notes["reason"] = REPLAY_DIVERGED
        return notes
