"""Admission of a call to its rollout (docs/architecture.md §5, step 1): its id and parent.

:func:`admit` takes the rollout's next ordinal (its id derives from it: a retried call is a new
sibling id; its seed derives from its prompt once that is made:
:meth:`~tasks.capture.rollout.RolloutCapture.seed_for`) and chooses the parent: the rollout's
latest call by default; under a message graph (:mod:`tasks.capture.graph`) the earlier
call the history extends with the same tools, else none, with the reason noted
(``root_reason``); under ``independent`` none after the first call.
:func:`check_history` then refuses a child whose messages do not extend its parent's
(``history_diverged``). :class:`AdmittedVersion` is the weight version a call keeps, stamped as it
goes to the engine: a call that spans a refit keeps it (``epoch_span``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks import ids
from tasks.capture.faults import HISTORY_DIVERGED, CallFault
from tasks.capture.graph import (
    INDEPENDENT,
    CanonicalMessage,
    canonical_conversation,
    find_parent,
    root_reason,
    tools_key,
)
from tasks.capture.rollout import ParentLink, RolloutCapture
from tasks.engines.base import Engine, WeightVersionSpan
from tasks.environments.base import Message


@dataclass(frozen=True)
class Admitted:
    """One admitted call: who it is, whether it is captured, what it continues, and its notes so far."""

    call_id: str
    captured: bool  # staged and recorded: capture is on and the rollout is not poisoned
    parent: ParentLink | None
    history: tuple[CanonicalMessage, ...]  # the messages it is called on, canonical
    tools: str  # the tools it offers the model (tools_key)
    notes: dict[str, Any] = field(default_factory=dict)  # the message graph's, staged in the extras

    @property
    def parent_call_id(self) -> str | None:
        return self.parent.call_id if self.parent is not None else None

    def staging_chain(self, rollout_id: str) -> tuple[str, ...]:
        """The staging keys root→this call."""
        return (*(self.parent.staging_chain if self.parent else ()), ids.staging_key(rollout_id, self.call_id))


def admit(
    rollout: RolloutCapture, messages: Sequence[Message], offered: Sequence[Mapping[str, Any]], *, capture: bool
) -> Admitted:
    """Admit the next call of ``rollout`` on ``messages`` offering ``offered`` tools (takes its ordinal)."""
    ordinal = rollout.take_ordinal()
    history = canonical_conversation(messages)
    tools = tools_key(offered)
    notes: dict[str, Any] = {}
    parent = rollout.parent
    if rollout.message_graph == INDEPENDENT:
        parent = None
        if ordinal > 0:
            notes["root_reason"] = INDEPENDENT
    elif rollout.message_graph is not None:
        parent = find_parent(rollout.links, history, tools)
        reason = None if parent is not None else root_reason(rollout.links, history, tools)
        if reason is not None:
            notes["root_reason"] = reason
    return Admitted(
        call_id=ids.call_id(rollout.rollout_id, rollout.attempt, ordinal),
        captured=capture and rollout.poisoned_reason is None,
        parent=parent,
        history=history,
        tools=tools,
        notes=notes,
    )


def check_history(call: Admitted) -> None:
    """Raise ``history_diverged`` unless ``call``'s messages extend everything its parent saw and replied."""
    if call.parent is None:
        return
    seen = len(call.parent.conversation)
    if call.history[:seen] != call.parent.conversation:
        raise CallFault(
            HISTORY_DIVERGED,
            f"the conversation of {call.call_id} does not extend its parent {call.parent.call_id}'s "
            f"{seen} messages: the environment rewrote earlier history",
        )


@dataclass(frozen=True)
class AdmittedVersion:
    """The weight version a call keeps, and when it went to the engine.

    ``epoch_span`` is known at once when the engine reported its weight spans; otherwise (None) it
    is whether the engine's version moved while the call ran.
    """

    weight_version: int
    at: float
    epoch_span: bool | None = None

    @classmethod
    def stamp(cls, engine: Engine) -> AdmittedVersion:
        """The engine's version now."""
        return cls(weight_version=engine.weight_version, at=time.time())

    def spanning(self, spans: Sequence[WeightVersionSpan]) -> AdmittedVersion:
        """As the engine reported it: the first span's version, spanning a refit when the spans differ."""
        if not spans:
            return self
        return AdmittedVersion(spans[0].version, self.at, epoch_span=len({span.version for span in spans}) > 1)

    def spanned(self, engine: Engine) -> bool:
        """Whether the call spanned a refit: as reported, else whether the engine's version moved since."""
        return self.epoch_span if self.epoch_span is not None else engine.weight_version != self.weight_version
