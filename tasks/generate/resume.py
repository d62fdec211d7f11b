"""Where a new attempt resumes each rollout earlier attempts left without a receipt (docs/reliability.md, "Resume").

:func:`resume_points` rebuilds, from storage alone, the replay book of every such rollout: its call
records (handed over by recovery, :class:`~tasks.storage.recovery.CommittedCall`) and their staged
deltas, read once per segment. A rollout's episodes are told apart by the resume notes in the
extras of their live calls (:meth:`tasks.capture.replay.ReplayBook.notes`): the first episode's
calls note nothing; episode ``e``'s note which entries of the book before them they replayed (by
index; a count ``m`` from earlier versions: the first ``m``), so ``book(e)`` is those entries of
``book(e')``, in its order, then ``calls(e)``, for the latest episode ``e'`` before it that
committed a call. The latest book is what the new attempt replays, in a new episode.

A book that cannot be trusted is not replayed: the rollout starts again from nothing, the reason
kept (:data:`REPLAY_REFUSED` with the detail). That is a note that does not parse or names more
entries than its book had, first-episode calls in two attempts (written without resume), a delta
that is not prompt tokens then sampled ones, or sampled ids that do not decode to the text the call
recorded (its ``output_fingerprint``). So is a book that cannot be read: a call whose staged row
storage does not hold as its record committed it (the staged reader's ``StorageIntegrityError``:
a segment absent, not Parquet, of another schema, a row past its end, of another call or breaking
the staged delta's rules; or a row whose digest is not its record's, :data:`WRONG_DIGEST`, or not
that of its own contents, :data:`CORRUPT_DIGEST`). The detail names the call and the reason.

Invariant: a rollout is refused only for its own calls. A bad segment or row refuses the books of
the rollouts with a call in it; the others resume. A store that does not answer (any other error:
the retry policy's ``StorageUnavailableError``, credentials, permissions) is no finding on the
contents: it propagates, the attempt fails, and the retry reads again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks import ids
from tasks.capture.replay import RESUME_NOTES, BookEntry
from tasks.capture.terminal import fingerprint_content
from tasks.errors import StorageIntegrityError
from tasks.records.ledger import StagedDelta
from tasks.storage.recovery import CommittedCall
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import CommitCoordinates

REPLAY_REFUSED = "replay_refused"  # the committed calls of a rollout cannot be replayed consistently
# A staged row that is not the call its record committed (the names finalize gives the same findings):
WRONG_DIGEST = "wrong_digest"  # its digest is not the one its call record holds
CORRUPT_DIGEST = "corrupt_digest"  # its digest is not that of its own contents
MAX_DETAIL_CHARS = 300  # of a storage error's message kept in a refusal


@dataclass(frozen=True)
class ResumePoint:
    """What a rollout's new episode starts from: the book of ``episode`` (the latest that committed a call),
    or nothing and why (``problem``)."""

    entries: tuple[BookEntry, ...]
    episode: int
    problem: str | None = None


class _Untrusted(ValueError):
    """A book that cannot be replayed; its message says why."""


async def resume_points(
    unreceipted: Mapping[str, Sequence[CommittedCall]],
    rollout_ids: Iterable[str],
    reader: StagedReader,
    decode: Callable[[Sequence[int]], str],
) -> dict[str, ResumePoint]:
    """The resume point of each of ``rollout_ids`` that earlier attempts left calls of (the others start afresh).

    ``decode``: sampled ids to the text the engine reported for them (:meth:`tasks.engines.base.Engine.decode`).
    Reading staging and decoding run in a thread.
    """
    calls = {rollout: unreceipted[rollout] for rollout in rollout_ids if unreceipted.get(rollout)}
    if not calls:
        return {}
    return await asyncio.to_thread(_points, calls, reader, decode)


def _points(
    calls: Mapping[str, Sequence[CommittedCall]], reader: StagedReader, decode: Callable[[Sequence[int]], str]
) -> dict[str, ResumePoint]:
    deltas, unreadable = _read(calls, reader)
    points = {}
    for rollout, found in calls.items():
        staged = [(call, deltas[call.record.call_id]) for call in found if call.record.call_id in deltas]
        try:
            if rollout in unreadable:
                raise _Untrusted(unreadable[rollout])
            points[rollout] = _point(staged, decode)
        except _Untrusted as untrusted:
            # An unreadable call's episode is unknown, but it stays unreadable (no object is ever rewritten): every
            # later resume refuses this book again, so the new episode need only follow the episodes read.
            points[rollout] = ResumePoint((), _latest_episode(staged), f"{REPLAY_REFUSED}: {untrusted}")
    return points


def _read(
    calls: Mapping[str, Sequence[CommittedCall]], reader: StagedReader
) -> tuple[dict[str, StagedDelta], dict[str, str]]:
    """Each call's staged delta by call id, and why each rollout with a call whose delta cannot be read has no book
    (naming the first such call found).

    One fetch per segment; only a fetch that fails on the contents is narrowed to the calls it holds
    (:func:`_fetch_segment`), so a bad segment or row refuses only the rollouts with a call in it. Any
    other error is the store's and propagates.
    """
    by_segment: dict[str, list[CommittedCall]] = {}
    for found in calls.values():
        for call in found:
            by_segment.setdefault(call.record.staging_segment, []).append(call)
    deltas: dict[str, StagedDelta] = {}
    unreadable: dict[str, str] = {}
    for segment, found in by_segment.items():
        for call, delta in _fetch_segment(reader, segment, found):
            problem = _mismatch(call, delta) if isinstance(delta, StagedDelta) else _unreadable(call, delta)
            if problem is None:
                deltas[call.record.call_id] = delta
            else:
                unreadable.setdefault(call.record.rollout_id, problem)
    return deltas, unreadable


def _fetch_segment(
    reader: StagedReader, segment: str, found: Sequence[CommittedCall]
) -> list[tuple[CommittedCall, StagedDelta | StorageIntegrityError]]:
    """The staged delta of each of ``found`` (calls whose rows ``segment`` holds), or what storage holds wrong there:
    all fetched at once, narrowed when that fails on the contents (only their errors are caught)."""
    try:
        return list(zip(found, reader.fetch_records([_request(call) for call in found]), strict=True))
    except StorageIntegrityError:
        return _narrowed(reader, segment, found)


def _narrowed(
    reader: StagedReader, segment: str, found: Sequence[CommittedCall]
) -> list[tuple[CommittedCall, StagedDelta | StorageIntegrityError]]:
    """What :func:`_fetch_segment` returns once a fetch of every call failed: a segment that does not read as a whole
    fails each of ``found``; else each is fetched alone (from the reader's cached segment), so a bad row fails only
    its own call."""
    try:
        reader.segment(segment)
    except StorageIntegrityError as whole:
        return [(call, whole) for call in found]
    fetched: list[tuple[CommittedCall, StagedDelta | StorageIntegrityError]] = []
    for call in found:
        try:
            fetched.append((call, reader.fetch_records([_request(call)])[0]))
        except StorageIntegrityError as bad:
            fetched.append((call, bad))
    return fetched


def _request(call: CommittedCall) -> tuple[str, CommitCoordinates]:
    """How the staged reader asks for ``call``'s row."""
    coordinates = CommitCoordinates(call.record.staging_segment, call.record.staging_row)
    return ids.staging_key(call.record.rollout_id, call.record.call_id), coordinates


def _unreadable(call: CommittedCall, error: StorageIntegrityError) -> str:
    """Why ``call``'s book cannot be read: its staged row is not there as committed (``error``'s reason and words)."""
    detail = str(error)
    if len(detail) > MAX_DETAIL_CHARS:
        detail = f"{detail[:MAX_DETAIL_CHARS]}..."
    return f"the staged row of {call.record.call_id} cannot be read ({error.reason}): {detail}"


def _mismatch(call: CommittedCall, delta: StagedDelta) -> str | None:
    """Why ``delta`` is not the call ``call`` committed (its digest), or None when it is."""
    record = call.record
    row = f"the staged row of {record.call_id} (row {record.staging_row} of segment {record.staging_segment})"
    if delta.digest != record.digest:
        return f"{row} is not the one its call record committed ({WRONG_DIGEST})"
    if delta.recompute_digest() != delta.digest:
        return f"{row} does not hash to its digest ({CORRUPT_DIGEST})"
    return None


def _point(staged: Sequence[tuple[CommittedCall, StagedDelta]], decode: Callable[[Sequence[int]], str]) -> ResumePoint:
    """The book of the latest episode of one rollout's committed calls (attempt order, then ledger order).

    ``book(e)`` is the entries of the book before it that episode ``e``'s live calls name as replayed (the
    union of their notes: each names what was replayed when it was made), in that book's order, then
    ``e``'s own calls.
    """
    episodes: dict[int, list[tuple[CommittedCall, StagedDelta]]] = {}
    replayed_of: dict[int, set[int] | int] = {}
    for call, delta in staged:
        episode, replayed = _notes(delta)
        replayed_of[episode] = _noted_together(replayed_of.get(episode), replayed, episode)
        episodes.setdefault(episode, []).append((call, delta))
    first_attempts = {call.attempt for call, _ in episodes.get(0, ())}
    if len(first_attempts) > 1:
        raise _Untrusted(f"first-episode calls in attempts {sorted(first_attempts)} (written without resume)")
    book: list[BookEntry] = []
    for episode in sorted(episodes):
        noted = replayed_of[episode]
        kept = set(range(noted)) if isinstance(noted, int) else noted
        if kept and max(kept) >= len(book):
            raise _Untrusted(f"episode {episode} names replayed entries {sorted(kept)} of a book of {len(book)}")
        book = [
            *(entry for index, entry in enumerate(book) if index in kept),
            *(_entry(call, delta, decode) for call, delta in episodes[episode]),
        ]
    return ResumePoint(tuple(book), max(episodes))


def _noted_together(before: set[int] | int | None, noted: set[int] | int, episode: int) -> set[int] | int:
    """What an episode's live calls name as replayed, together: the union of their sets of entries, or their one
    count (earlier versions noted the first ``m`` entries, and every call of an episode named the same ``m``)."""
    if before is None:
        return noted
    if isinstance(before, int) or isinstance(noted, int):
        if before != noted:
            raise _Untrusted(f"the calls of episode {episode} name different replay counts")
        return noted
    return before | noted


def _latest_episode(staged: Sequence[tuple[CommittedCall, StagedDelta]]) -> int:
    """The highest episode any note names (0 where none parses)."""
    latest = 0
    for _, delta in staged:
        try:
            latest = max(latest, _notes(delta)[0])
        except _Untrusted:
            continue
    return latest


def _notes(delta: StagedDelta) -> tuple[int, set[int] | int]:
    """(episode, the book's entries it replayed) a live call's extras note: a set of indexes, or a count ``m`` (the
    first ``m``, as earlier versions noted); (0, 0) for a call of a first episode."""
    try:
        extras: Any = json.loads(delta.extras_json)
    except ValueError:
        raise _Untrusted(f"the extras of {delta.call_id} do not parse") from None
    notes = extras.get(RESUME_NOTES) if isinstance(extras, dict) else None
    if notes is None:
        return 0, 0
    episode, replayed = (notes.get(key) if isinstance(notes, dict) else None for key in ("episode", "replayed"))
    indexes = replayed if isinstance(replayed, list) else []
    listed = isinstance(replayed, list) and all(type(i) is int and i >= 0 for i in indexes)
    counted = type(replayed) is int and replayed >= 0
    if not (type(episode) is int and episode >= 1 and (listed or counted)):
        raise _Untrusted(f"the resume notes of {delta.call_id} are malformed: {str(notes)[:200]}")
    return episode, set(indexes) if listed else replayed


def _entry(call: CommittedCall, delta: StagedDelta, decode: Callable[[Sequence[int]], str]) -> BookEntry:
    """The book entry of a committed call: its delta split into the prompt it added and what it sampled."""
    mask = np.asarray(delta.token_mask_delta)
    sampled = int(np.count_nonzero(mask))
    split = mask.size - sampled
    if sampled == 0 or np.any(mask[:split] != 0) or np.any(mask[split:] != 1):
        raise _Untrusted(f"the delta of {delta.call_id} is not prompt tokens then sampled ones")
    token_ids = tuple(int(t) for t in np.asarray(delta.token_ids_delta)[split:])
    text = decode(token_ids)
    if call.record.output_fingerprint is not None and fingerprint_content(text) != call.record.output_fingerprint:
        raise _Untrusted(f"the sampled ids of {delta.call_id} do not decode to the text it recorded")
    return BookEntry(
        record=call.record,
        prompt_tokens=np.asarray(delta.token_ids_delta, np.int64)[:split],
        token_ids=token_ids,
        logprobs=np.asarray(delta.logprobs_delta, np.float32)[split:],
        text=text,
        finish_reason=call.record.finish_reason,
        carried=True,
    )
