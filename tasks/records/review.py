"""The review decision: a person's publish-or-reject on a batch, recorded once in ``reports/review.json``.

A batch that a validation suite warned about (or whose Airflow run requires review) is published
only after a decision (:mod:`tasks.publish`). The decision is one JSON object, created once:

* one per batch, ever: a second decision with another choice is refused and the first stands;
  a rejected batch is never published;
* complete: the choice (``publish`` or ``reject``), a reason in the decider's words, who decided
  and when (seconds since the epoch), and where (``airflow``: the review task's form or its REST
  API; ``cli``: ``rollout-ledger publish --approve/--reject``; ``timeout``: nobody answered in
  time, which rejects with reason ``review_timeout`` and names nobody; ``validation``: publish
  itself, on a batch no suite warned about and no run required review, with reason
  ``no_review_needed``, naming nobody).

The record is the batch's one outcome slot: publish claims it (``validation``) before it commits
a batch nobody reviewed, so a rejection racing that publish loses to it, or wins and the publish
is refused (docs/validation.md). Publish copies a person's approval into
``dataset/_COMMITTED.json`` and the dataset card. Input from a person that breaks a rule raises
:class:`ReviewInputError`; a stored record that breaks one raises :class:`MalformedReviewError`
naming the file and the field. Records of every version written so far are read
(:func:`upgrade_record`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Self

from tasks.errors import MalformedReviewError, ReviewInputError
from tasks.ids import check_id
from tasks.strict_json import load_dataclass, parse_json

# 2: via ``validation`` (publish's own record of a batch that needed no review); 1 is read as 2
RECORD_VERSION = 2
READABLE_VERSIONS = (1, 2)
PUBLISH, REJECT = "publish", "reject"
CHOICES = (PUBLISH, REJECT)
UNREVIEWED = "validation"
SOURCES = ("airflow", "cli", "timeout", UNREVIEWED)
TIMEOUT_REASON = "review_timeout"
NO_REVIEW_REASON = "no_review_needed"
MAX_REASON_LENGTH = 2000
# The decision form a person answers (the Airflow review task, the CLI's flags map to the same):
# its buttons -> the recorded choice, and its one field, the reason. Empty by default (Airflow
# validates a task's params before the task runs); an answer without a reason is refused when it
# arrives (:func:`new_decision`).
OPTIONS = {"Publish": PUBLISH, "Reject": REJECT}
REASON_FIELD = "reason"
REASON_SCHEMA = {
    "default": "",
    "type": "string",
    "maxLength": MAX_REASON_LENGTH,
    "title": "Reason",
    "description": "required: why you publish or reject this batch; kept in its record and the dataset card",
}
MAX_NAME_LENGTH = 256


@dataclass(frozen=True)
class ReviewDecision:
    """``reports/review.json``; constructing one checks every rule of the module docstring."""

    batch_id: str
    choice: str
    reason: str
    decided_by: str | None
    decided_at: float
    via: str
    record_version: int = RECORD_VERSION

    def __post_init__(self) -> None:
        if self.record_version != RECORD_VERSION:
            raise ValueError(f"record_version {self.record_version!r} not supported (expected {RECORD_VERSION})")
        check_id(self.batch_id, field="batch_id")
        if self.choice not in CHOICES:
            raise ValueError(f"choice must be one of {list(CHOICES)}, got {self.choice!r}")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"reason must be a non-empty text saying why, got {self.reason!r}")
        if len(self.reason) > MAX_REASON_LENGTH:
            raise ValueError(f"reason has {len(self.reason)} characters; at most {MAX_REASON_LENGTH}")
        if self.via not in SOURCES:
            raise ValueError(f"via must be one of {list(SOURCES)}, got {self.via!r}")
        if self.via == "timeout":
            if (self.choice, self.reason, self.decided_by) != (REJECT, TIMEOUT_REASON, None):
                raise ValueError(f"a timeout rejects with reason {TIMEOUT_REASON!r} and names nobody as decider")
        elif self.via == UNREVIEWED:
            if (self.choice, self.reason, self.decided_by) != (PUBLISH, NO_REVIEW_REASON, None):
                raise ValueError(
                    f"publish's own record publishes with reason {NO_REVIEW_REASON!r} and names nobody as decider"
                )
        elif not isinstance(self.decided_by, str) or not self.decided_by.strip():
            raise ValueError(f"decided_by must name who decided, got {self.decided_by!r}")
        elif len(self.decided_by) > MAX_NAME_LENGTH:
            raise ValueError(f"decided_by has {len(self.decided_by)} characters; at most {MAX_NAME_LENGTH}")
        if isinstance(self.decided_at, bool) or not isinstance(self.decided_at, (int, float)):
            raise ValueError(f"decided_at must be seconds since the epoch, got {self.decided_at!r}")
        if not math.isfinite(self.decided_at) or self.decided_at <= 0:
            raise ValueError(f"decided_at must be seconds since the epoch, got {self.decided_at!r}")

    @property
    def approved(self) -> bool:
        return self.choice == PUBLISH

    @property
    def unreviewed(self) -> bool:
        """Whether publish recorded this itself: nobody needed to review the batch."""
        return self.via == UNREVIEWED

    def describe(self) -> str:
        """One line: ``publish by alice (cli) at 2026-05-01T10:00:00Z: looked at the warnings``."""
        if self.unreviewed:
            return f"publish without review at {utc_text(self.decided_at)}: {self.reason} (no suite warned)"
        who = "nobody answered (timeout)" if self.decided_by is None else f"by {self.decided_by} ({self.via})"
        return f"{self.choice} {who} at {utc_text(self.decided_at)}: {self.reason}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "reports/review.json") -> Self:
        """The record ``text`` holds; :class:`MalformedReviewError` naming the field for anything else."""
        raw = upgrade_record(parse_json(text, source=source, error=MalformedReviewError), source=source)
        return load_dataclass(cls, raw, source=source, error=MalformedReviewError, require_all=True)


def upgrade_record(raw: object, *, source: str) -> object:
    """A parsed record of any :data:`READABLE_VERSIONS` in the current shape; another version is refused.

    Version 1 holds the same fields as 2 (2 only allows one more ``via``), so only its number changes.
    """
    if not isinstance(raw, dict) or "record_version" not in raw:
        return raw  # the loader names what is wrong with it
    version = raw["record_version"]
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise MalformedReviewError(
            f"{source}: record_version {version!r} is not supported (this code reads {list(READABLE_VERSIONS)}); "
            "it was written by newer code: read it with that code"
        )
    return raw | {"record_version": RECORD_VERSION}


def new_decision(
    batch_id: str, choice: str, reason: str | None, *, decided_by: str, via: str, now: float | None = None
) -> ReviewDecision:
    """A person's decision, the reason stripped; :class:`ReviewInputError` naming what is wrong with the input."""
    if choice not in CHOICES:
        raise ReviewInputError(f"unknown review choice {choice!r}; choose one of {list(CHOICES)}")
    if via in ("timeout", UNREVIEWED):
        raise ReviewInputError(f"a person's decision is made via airflow or cli, not {via}")
    if reason is None or not str(reason).strip():
        raise ReviewInputError(f"a decision to {choice} needs a reason: say why (the record keeps it)")
    try:
        return ReviewDecision(
            batch_id=batch_id,
            choice=choice,
            reason=str(reason).strip(),
            decided_by=decided_by,
            decided_at=time.time() if now is None else now,
            via=via,
        )
    except (TypeError, ValueError) as exc:
        raise ReviewInputError(f"review decision on batch {batch_id}: {exc}") from None


def timeout_decision(batch_id: str, *, now: float | None = None) -> ReviewDecision:
    """The rejection a review nobody answered in time counts as (reason ``review_timeout``)."""
    return ReviewDecision(
        batch_id=batch_id,
        choice=REJECT,
        reason=TIMEOUT_REASON,
        decided_by=None,
        decided_at=time.time() if now is None else now,
        via="timeout",
    )


def unreviewed_decision(batch_id: str, *, now: float | None = None) -> ReviewDecision:
    """Publish's own record of a batch nobody needed to review (reason ``no_review_needed``)."""
    return ReviewDecision(
        batch_id=batch_id,
        choice=PUBLISH,
        reason=NO_REVIEW_REASON,
        decided_by=None,
        decided_at=time.time() if now is None else now,
        via=UNREVIEWED,
    )


def utc_text(seconds: float) -> str:
    """``2026-05-01T10:00:00Z``."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
