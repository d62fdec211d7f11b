"""Which call of a rollout was scored: terminal attribution for the receipt (docs/architecture.md §7).

Fail-closed rule: a rollout is trained on the chain root→terminal, so the terminal is named
only when the evidence names exactly one call. Every witness abstains rather than guesses; a
declared terminal is authoritative and never falls back; witnesses that name different calls,
a malformed manifest, or a branching history give no terminal and a named reason, and the
rollout is then poisoned instead of being trained on a guessed chain.

Witnesses, strongest first: ``declared`` (the runner names the call), ``response_id`` (the scored
response's id matched against ``record.response_id``), ``content`` (the fingerprint of the scored
assistant content matched against ``record.output_fingerprint``). Without any answer, the
``heuristic`` walks the call tree (:func:`select_terminal_call`).

Records are duck-typed: ``call_id``, ``parent_call_id`` and ``admitted_at`` (float seconds or
None) for the heuristic; ``response_id`` and ``output_fingerprint`` for the witnesses (missing
attributes read as None). Manifest order is the order given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

from tasks.checks import check_hex_digest

SELECTED = "selected"
NO_RECORDS = "no_records"
DUPLICATE_CALL_ID = "duplicate_call_id"
ORPHANED_ROW = "orphaned_row"
NO_ROOT = "no_root"
AMBIGUOUS_TERMINAL = "ambiguous_terminal"
DECLARED_TERMINAL_NOT_CAPTURED = "declared_terminal_not_captured"
DECLARED_AMBIGUOUS = "declared_ambiguous"
WITNESS_DISAGREEMENT = "witness_disagreement"

HEURISTIC_REASONS = (SELECTED, NO_RECORDS, DUPLICATE_CALL_ID, ORPHANED_ROW, NO_ROOT, AMBIGUOUS_TERMINAL)
ATTRIBUTION_REASONS = (*HEURISTIC_REASONS, DECLARED_TERMINAL_NOT_CAPTURED, DECLARED_AMBIGUOUS, WITNESS_DISAGREEMENT)


class CallLike(Protocol):
    """What the heuristic reads from a call record."""

    @property
    def call_id(self) -> str: ...

    @property
    def parent_call_id(self) -> str | None: ...

    @property
    def admitted_at(self) -> float | None: ...


class TerminalSelection(NamedTuple):
    """The heuristic's answer: a call id with reason ``selected``, else None and why not."""

    terminal_call_id: str | None
    reason: str


class TerminalAttribution(NamedTuple):
    """The receipt's terminal: call id and method together, or neither; ``reason`` always set."""

    terminal_call_id: str | None
    selection_method: str | None
    reason: str


def fingerprint_content(text: str) -> str:
    """sha256 hex of the UTF-8 assistant content: what ``output_fingerprint`` records."""
    if not isinstance(text, str):
        raise TypeError(f"assistant content must be a str, got {type(text).__name__}")
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def select_terminal_call(records: Iterable[CallLike]) -> TerminalSelection:
    """The heuristic: walk down the call tree from the earliest surviving root.

    Checks, in order: no rows ⇒ ``no_records``; a repeated call id ⇒ ``duplicate_call_id``; a
    parent not in the manifest ⇒ ``orphaned_row``; no root ⇒ ``no_root``. The survivors of a
    set of calls are those with children, or all of them when none has any (an abandoned retry
    is a childless sibling). Start at the earliest surviving root (stamped ``admitted_at``
    ascending, unstamped last, ties by manifest position); a call without children is
    ``selected``; exactly one surviving child ⇒ descend; several ⇒ ``ambiguous_terminal``.
    """
    rows = list(records)
    if not rows:
        return TerminalSelection(None, NO_RECORDS)
    call_ids = [row.call_id for row in rows]
    if len(set(call_ids)) != len(call_ids):
        return TerminalSelection(None, DUPLICATE_CALL_ID)
    known = set(call_ids)
    if any(row.parent_call_id is not None and row.parent_call_id not in known for row in rows):
        return TerminalSelection(None, ORPHANED_ROW)
    children: dict[str | None, list[int]] = {}
    for position, row in enumerate(rows):
        children.setdefault(row.parent_call_id, []).append(position)
    roots = children.get(None, [])
    if not roots:
        return TerminalSelection(None, NO_ROOT)

    def survivors(positions: list[int]) -> list[int]:
        with_children = [p for p in positions if rows[p].call_id in children]
        return with_children or positions

    def admission_order(position: int) -> tuple[bool, float, int]:
        stamp = rows[position].admitted_at
        stamped = isinstance(stamp, (int, float)) and math.isfinite(stamp)
        return (not stamped, float(stamp) if stamped else 0.0, position)

    current = min(survivors(roots), key=admission_order)
    while True:
        below = children.get(rows[current].call_id)
        if not below:
            return TerminalSelection(rows[current].call_id, SELECTED)
        surviving = survivors(below)
        if len(surviving) > 1:
            return TerminalSelection(None, AMBIGUOUS_TERMINAL)
        current = surviving[0]


def declared_terminal(records: Sequence[Any], declared_call_id: str) -> TerminalSelection:
    """The declared witness: authoritative, so a missing or ambiguous match is a named failure."""
    matches = [row for row in records if row.call_id == declared_call_id]
    if not matches:
        return TerminalSelection(None, DECLARED_TERMINAL_NOT_CAPTURED)
    if any(not _same_row(matches[0], other) for other in matches[1:]):
        return TerminalSelection(None, DECLARED_AMBIGUOUS)
    return TerminalSelection(declared_call_id, SELECTED)


def matching_call(records: Sequence[Any], field: str, value: str) -> str | None:
    """The one call id whose ``field`` equals ``value``; None (abstain) for no match or several."""
    found = {row.call_id for row in records if getattr(row, field, None) == value}
    return found.pop() if len(found) == 1 else None


def attribute_terminal(
    records: Iterable[Any],
    *,
    declared_call_ids: Sequence[str] = (),
    response_id: str | None = None,
    content_fingerprint: str | None = None,
) -> TerminalAttribution:
    """The receipt's terminal call from every witness given, the heuristic when none answers.

    ``declared_call_ids`` holds one declaration per channel that made one (e.g. an agent's result
    and the gateway's final-response header). A declared terminal that is not captured or is
    ambiguous ends attribution (no fallback). Witnesses that answer must name the same call (else
    ``witness_disagreement``); the method is the strongest witness that answered. Only when none
    answered does the heuristic run.
    """
    rows = list(records)
    if response_id is not None and (not isinstance(response_id, str) or not response_id):
        raise ValueError(f"response_id must be a non-empty str or None, got {response_id!r}")
    if content_fingerprint is not None:
        check_hex_digest(content_fingerprint, field="content_fingerprint")
    answers: list[tuple[str, str]] = []
    for declared_call_id in declared_call_ids:
        declared = declared_terminal(rows, declared_call_id)
        if declared.terminal_call_id is None:
            return TerminalAttribution(None, None, declared.reason)
        answers.append(("declared", declared.terminal_call_id))
    for method, field, value in (
        ("response_id", "response_id", response_id),
        ("content", "output_fingerprint", content_fingerprint),
    ):
        if value is not None and (found := matching_call(rows, field, value)) is not None:
            answers.append((method, found))
    if answers:
        if len({call for _, call in answers}) > 1:
            return TerminalAttribution(None, None, WITNESS_DISAGREEMENT)
        method, call = answers[0]
        return TerminalAttribution(call, method, SELECTED)
    heuristic = select_terminal_call(rows)
    method = "heuristic" if heuristic.terminal_call_id is not None else None
    return TerminalAttribution(heuristic.terminal_call_id, method, heuristic.reason)


def _same_row(a: Any, b: Any) -> bool:
    """Two manifest rows are the same row when every field is equal (unknown shapes: identity)."""
    if a is b:
        return True
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a))
    if hasattr(a, "__dict__") and hasattr(b, "__dict__"):
        return vars(a) == vars(b)
    return False
