"""The capture state of one rollout, kept in one place across its calls (docs/architecture.md §5).

:class:`RolloutCapture` is everything a rollout's next call depends on: ids and seed, the next
ordinal, the prompts its episode asked (seeds derive from them), the calls a child may continue
(:class:`ParentLink`), its manifest (:class:`CallManifest`) and failures, the episode and its
replay book (:mod:`tasks.capture.replay`), and the counts its receipt reports. The steps of a call
read it; only the methods below change it, once a call has an outcome. Invariants: ordinals only
grow (no call id repeats, a restart included); a call's seed derives from its prompt and how many
calls of its episode asked that prompt before it (:meth:`RolloutCapture.seed_for`), so it is the
same in every episode and whatever order concurrent calls arrive in; any failure poisons the
rollout for good; ``parent`` is the latest call on the current chain; the manifest lists the calls
replayed from earlier attempts, then this attempt's own, by construction.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tasks import ids
from tasks.capture.graph import CanonicalMessage
from tasks.capture.replay import BookEntry, ReplayBook
from tasks.engines.base import SERVED_BY, GenerationResult
from tasks.records.ledger import CallRecord, FailureRow


@dataclass(frozen=True)
class ParentLink:
    """What a child call needs of its parent: the captured call it continues."""

    call_id: str
    cum_len: int
    chain_hash: str
    staging_chain: tuple[str, ...]  # staging keys root→this call
    conversation: tuple[CanonicalMessage, ...]  # the messages the call saw, plus its assistant reply
    prompt_length: int  # how many of those messages the call saw
    tools: str  # the tools it offered the model (tasks.capture.graph.tools_key)
    token_ids: np.ndarray  # the whole sequence through this call (kept in memory for uncaptured runs)

    @classmethod
    def of(
        cls,
        call_id: str,
        sequence: np.ndarray,
        chain_hash: str,
        chain: tuple[str, ...],
        conversation: tuple[CanonicalMessage, ...],
        prompt_length: int,
        tools: str,
    ) -> ParentLink:
        """The link of a finished call whose whole sequence is ``sequence`` (made read-only here)."""
        sequence.setflags(write=False)
        return cls(call_id, int(sequence.size), chain_hash, chain, conversation, prompt_length, tools, sequence)


@dataclass
class CallManifest:
    """The receipt's manifest as a rollout builds it (docs/architecture.md §8): the calls of earlier attempts it
    replayed, each once, in the order they were first replayed, then this attempt's own calls in the order they
    were recorded. The two lists are apart, so that order is the type's, whatever order calls come in."""

    carried: list[CallRecord] = field(default_factory=list)
    own: list[CallRecord] = field(default_factory=list)

    def carry(self, record: CallRecord) -> bool:
        """Add a call of an earlier attempt replayed now; False when it is in the manifest already."""
        if any(known.call_id == record.call_id for known in self.carried):
            return False
        self.carried.append(record)
        return True

    def record(self, record: CallRecord) -> None:
        """Add a call this attempt recorded."""
        self.own.append(record)

    @property
    def records(self) -> list[CallRecord]:
        """The whole manifest: carried calls, then own calls."""
        return [*self.carried, *self.own]

    @property
    def carried_ids(self) -> list[str]:
        """The receipt's ``replayed_calls``."""
        return [record.call_id for record in self.carried]


@dataclass
class RolloutCapture:
    """Capture state of one rollout across its calls."""

    batch_id: str
    rollout_id: str
    attempt: int
    seed: int
    message_graph: str | None = None  # the gateway's: splice or independent; None: the previous call is the parent
    book: ReplayBook | None = None  # the committed calls this episode replays first (None: nothing to replay)
    resume: bool = True  # a restart replays what the episode committed (the batch's ``resume: turn``)
    next_ordinal: int = 0
    episode: int = 0  # 0: its first run; each start from the first turn begins the next
    asked: Counter[str] = field(default_factory=Counter)  # prompt digest -> calls of this episode that asked it
    parent: ParentLink | None = None  # the latest call
    links: list[ParentLink] = field(default_factory=list)  # every call, when ``message_graph``
    manifest: CallManifest = field(default_factory=CallManifest)
    failures: list[FailureRow] = field(default_factory=list)
    last_captured_call_id: str | None = None
    epoch_spans: int = 0
    generated_tokens: int = 0
    served_by: Counter[str] = field(default_factory=Counter)  # answers per server, where the engine names it
    failed_over: list[str] = field(default_factory=list)  # each restart after its server was lost: why
    episode_calls: list[BookEntry] = field(default_factory=list)  # committed calls of this episode, in order
    replayed_calls: int = 0  # calls answered from a book, every episode
    live_calls: int = 0  # calls recorded from the engine after a replay began (a resumed rollout's)
    divergences: int = 0  # live calls that left an entry of their parent unanswered (replay_diverged)
    resume_restarts: list[str] = field(default_factory=list)  # each episode that could not replay: why

    @property
    def records(self) -> list[CallRecord]:
        """The manifest's calls: carried, then own."""
        return self.manifest.records

    @property
    def carried(self) -> list[str]:
        """The calls of earlier attempts in the manifest, in replay order: the receipt's ``replayed_calls``."""
        return self.manifest.carried_ids

    @property
    def poisoned_reason(self) -> str | None:
        """The first failure's reason: any failure on the chain poisons the rollout."""
        return self.failures[0].reason if self.failures else None

    def take_ordinal(self) -> int:
        """The next call's ordinal; the one after it is next."""
        self.next_ordinal += 1
        return self.next_ordinal - 1

    def seed_for(self, prompt: np.ndarray) -> int:
        """The seed of the call of this episode on ``prompt`` (its whole prompt): from the rollout's seed, the
        prompt's digest and how many calls of the episode asked the same prompt before it. Count every call, a
        replayed one too, so a live call after a replay gets the seed it had in the first episode."""
        digest = hashlib.sha256(np.ascontiguousarray(prompt, np.int64).tobytes()).hexdigest()[:32]
        occurrence = self.asked[digest]
        self.asked[digest] += 1
        return ids.derive_seed(self.seed, "call", digest, occurrence)

    def generated(self, completion: GenerationResult) -> None:
        """Count an engine answer: its tokens, and the server that gave it where the engine names one."""
        self.generated_tokens += len(completion.token_ids)
        if isinstance(server := completion.metadata.get(SERVED_BY), str):
            self.served_by[server] += 1

    def linked(self, link: ParentLink) -> None:
        """A call finished: the next call continues it (or, under a message graph, any call linked so far)."""
        self.parent = link
        if self.message_graph is not None:
            self.links.append(link)

    def recorded(self, entry: BookEntry, link: ParentLink, *, diverged: bool = False) -> None:
        """A captured call's record was handed to the ledger (``diverged``: it left a replay entry unanswered)."""
        self.divergences += int(diverged)
        self.manifest.record(entry.record)
        self.last_captured_call_id = entry.record.call_id
        self.epoch_spans += int(entry.record.epoch_span)
        self.episode_calls.append(entry)
        self.live_calls += int(self.episode > 0)
        self.linked(link)

    def replayed(self, entry: BookEntry, link: ParentLink) -> None:
        """A call was answered from the book: a carried ``entry``'s record joins the manifest (once)."""
        if entry.carried and self.manifest.carry(entry.record):
            self.epoch_spans += int(entry.record.epoch_span)
        self.last_captured_call_id = entry.record.call_id
        self.episode_calls.append(entry)
        self.replayed_calls += 1
        self.linked(link)

    def failed(self, failure: FailureRow) -> None:
        """A captured call failed: the rollout is poisoned."""
        self.failures.append(failure)

    def restart(self, why: str) -> None:
        """Start the rollout again from its first turn, in a new episode that replays what this one committed
        (with ``resume`` off: sampling it all again, no episode noted): calls it does not replay stay in the
        ledger, off the new chain.

        Ordinals go on (no call id repeats), the episode's asked prompts start again, and the manifest
        and failures are kept: the receipt counts every call the ledger holds of the rollout, and a
        failure before the restart still poisons it.
        """
        self.parent, self.links, self.last_captured_call_id = None, [], None
        self.failed_over.append(why)
        if self.resume:
            self.begin_episode(self.episode_calls, self.episode + 1)
        else:
            self.asked, self.episode_calls = Counter(), []

    def begin_episode(self, entries: list[BookEntry] | tuple[BookEntry, ...], episode: int) -> None:
        """Begin episode ``episode`` (from the first turn), replaying ``entries`` first."""
        self.episode = episode
        self.book = ReplayBook(entries, episode=episode)
        self.episode_calls = []
        self.asked = Counter()

    def could_not_replay(self, why: str) -> None:
        """The committed calls cannot be replayed consistently: the episode starts from nothing, saying why."""
        self.resume_restarts.append(why)

    def release(self) -> None:
        """Drop the tokens a finished rollout holds (its records stay)."""
        self.parent = None
        self.links.clear()
        self.episode_calls = []
        self.book = None
