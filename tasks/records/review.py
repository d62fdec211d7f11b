"""The review decision: a person's publish-or-reject on a batch, recorded once in ``reports/review.json``.

A batch that a validation suite warned about (or whose Airflow run requires review) is published
only after a decision (:mod:`tasks.publish`). The decision is one JSON object, created once:

* one per batch, ever: a second decision with another choice is refused and the first stands;
  a rejected batch is never published;
* complete: the choice (``publish`` or ``reject``), a reason in the decider's words, who decided
  and when (seconds since the epoch), and where (``airflow``: the review task's form or its REST
  API; ``cli``: ``rollout-ledger publish --approve/--reject``; ``timeout``: nobody answered in
  time, which rejects with reason ``review_timeout`` and names nobody).

Publish copies an approval into ``dataset/_COMMITTED.json`` and the dataset card. Input from a
person that breaks a rule raises :class:`ReviewInputError`; a stored record that breaks one raises
:class:`MalformedReviewError` naming the file and the field.
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

RECORD_VERSION = 1
PUBLISH, REJECT = "publish", "reject"
CHOICES = (PUBLISH, REJECT)
SOURCES = ("airflow", "cli", "timeout")
TIMEOUT_REASON = "review_timeout"
MAX_REASON_LENGTH = 2000
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

    def describe(self) -> str:
        """One line: ``publish by alice (cli) at 2026-05-01T10:00:00Z: looked at the warnings``."""
        who = "nobody answered (timeout)" if self.decided_by is None else f"by {self.decided_by} ({self.via})"
        return f"{self.choice} {who} at {utc_text(self.decided_at)}: {self.reason}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "reports/review.json") -> Self:
        """The record ``text`` holds; :class:`MalformedReviewError` naming the field for anything else."""
        raw = parse_json(text, source=source, error=MalformedReviewError)
        return load_dataclass(cls, raw, source=source, error=MalformedReviewError, require_all=True)


def new_decision(
    batch_id: str, choice: str, reason: str | None, *, decided_by: str, via: str, now: float | None = None
) -> ReviewDecision:
    """A person's decision, the reason stripped; :class:`ReviewInputError` naming what is wrong with the input."""
    if choice not in CHOICES:
        raise ReviewInputError(f"unknown review choice {choice!r}; choose one of {list(CHOICES)}")
    if via == "timeout":
        raise ReviewInputError("a person's decision is made via airflow or cli, not timeout")
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


def utc_text(seconds: float) -> str:
    """``2026-05-01T10:00:00Z``."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
