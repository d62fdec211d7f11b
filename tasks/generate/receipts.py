"""A rollout's final word: its receipt, and the outcome the training-signal summary keeps of it.

Pure functions of what the rollout captured. A receipt is ``ok`` only with a reward and an
attributed terminal call; an environment error makes it ``failed`` (:data:`ENVIRONMENT_ERROR`,
or the agent's named failure), a poisoned capture or a missing terminal or reward makes it
``poisoned`` with the reason, and neither names a terminal call. The terminal's witnesses are
:class:`Witnesses`: by default the episode's last captured call is the declared one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks.capture.rollout import RolloutCapture
from tasks.capture.terminal import attribute_terminal
from tasks.environments.base import Turn
from tasks.records.ledger import (
    COULD_NOT_REPLAY,
    FAILED_OVER_NOTE,
    RESUMED_COUNTS,
    RESUMED_NOTE,
    SERVED_BY_NOTE,
    CallRecord,
    Receipt,
    canonical_json,
)
from tasks.records.planned import PlannedRollout
from tasks.training_signal import RolloutOutcome

ENVIRONMENT_ERROR = "environment_error"


def outcome_of(receipt: Receipt, manifest: Sequence[CallRecord]) -> RolloutOutcome:
    """What the training-signal summary needs of a receipted rollout (truncated: its terminal hit max_tokens)."""
    terminal = next((c for c in manifest if c.call_id == receipt.terminal_call_id), None)
    return RolloutOutcome(
        group_id=receipt.group_id,
        status=receipt.status,
        reward=receipt.reward,
        failure_reason=receipt.failure_reason,
        truncated=terminal is not None and terminal.finish_reason == "length",
    )


@dataclass(frozen=True)
class Witnesses:
    """What names the scored call, beyond the heuristic: declared call ids (one per channel that
    declared one, all must agree) and the scored content's fingerprint."""

    declared_call_ids: tuple[str, ...] = ()
    content_fingerprint: str | None = None


def capture_notes(state: RolloutCapture) -> dict[str, Any]:
    """What the receipt's reward info says of where the rollout's calls ran: ``served_by`` (answers per
    server, for an engine of several), ``failed_over`` (each restart after its server was lost) and
    ``resumed`` (calls replayed and sampled live after a replay began, divergences, episodes that
    could not replay and why), each only when there is something to say."""
    notes: dict[str, Any] = {}
    if state.served_by:
        notes[SERVED_BY_NOTE] = dict(sorted(state.served_by.items()))
    if state.failed_over:
        notes[FAILED_OVER_NOTE] = list(state.failed_over)
    if state.episode > 0 or state.resume_restarts:
        counts = (state.episode, state.replayed_calls, state.live_calls, state.divergences)
        resumed: dict[str, Any] = dict(zip(RESUMED_COUNTS, counts, strict=True))
        if state.resume_restarts:
            resumed[COULD_NOT_REPLAY] = list(state.resume_restarts)
        notes[RESUMED_NOTE] = resumed
    return notes


def receipt_of(
    planned: PlannedRollout,
    state: RolloutCapture,
    outcome: Turn | None,
    error: str | None,
    *,
    error_reason: str = ENVIRONMENT_ERROR,
    witnesses: Witnesses | None = None,
    poisoning_wins: bool = False,
    notes: Mapping[str, Any] | None = None,
) -> Receipt:
    """The rollout's final word; without ``witnesses`` the declared terminal is the episode's last captured call.

    ``error`` fails the rollout with ``error_reason``; with ``poisoning_wins`` a poisoned capture
    is the reason instead (an agent often fails because one of its calls was refused). ``notes``
    join the reward info whatever the outcome (the gateway's refusals), as do the capture's
    (:func:`capture_notes`).
    """
    reward = outcome.reward if outcome is not None else None
    info = {**(outcome.reward_info if outcome is not None else {}), **capture_notes(state), **(notes or {})}
    if error is not None:
        info["error"] = error
    common = {
        "rollout_id": planned.rollout_id,
        "group_id": planned.group_id,
        "attempt": state.attempt,
        "reward": reward,
        "reward_info": canonical_json(info),
        "num_calls": len(state.records),
        "replayed_calls": tuple(state.carried),
    }
    unfinished = {"terminal_call_id": None, "terminal_selection": None, "terminal_attribution_reason": None}
    if error is not None and not (poisoning_wins and state.poisoned_reason is not None):
        return Receipt(**common, **unfinished, status="failed", failure_reason=error_reason)
    if state.poisoned_reason is not None:
        return Receipt(**common, **unfinished, status="poisoned", failure_reason=state.poisoned_reason)
    if witnesses is None:
        last = state.last_captured_call_id
        witnesses = Witnesses(declared_call_ids=() if last is None else (last,))
    attribution = attribute_terminal(
        state.records,
        declared_call_ids=witnesses.declared_call_ids,
        content_fingerprint=witnesses.content_fingerprint,
    )
    if attribution.terminal_call_id is None or reward is None:
        reason = attribution.reason if attribution.terminal_call_id is None else "no_reward"
        return Receipt(**common, **unfinished, status="poisoned", failure_reason=reason)
    return Receipt(
        **common,
        terminal_call_id=attribution.terminal_call_id,
        terminal_selection=attribution.selection_method,
        terminal_attribution_reason=attribution.reason,
        status="ok",
        failure_reason=None,
    )
