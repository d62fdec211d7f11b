"""The review decision record (``reports/review.json``): one schema, strictly parsed, written once."""

from __future__ import annotations

import json

import pytest

from tasks.batch import Batch
from tasks.errors import MalformedReviewError, ReviewInputError
from tasks.layout import REVIEW_RECORD
from tasks.publish import write_review
from tasks.records.review import (
    NO_REVIEW_REASON,
    TIMEOUT_REASON,
    ReviewDecision,
    new_decision,
    timeout_decision,
    unreviewed_decision,
)

AT = 1_790_000_000.0  # 2026-09-21T14:13:20Z


@pytest.fixture
def batch(tmp_path) -> Batch:
    return Batch.open(str(tmp_path), "b1")


def approval(**overrides) -> ReviewDecision:
    fields = {"choice": "publish", "reason": "warnings read", "decided_by": "alice", "via": "cli", "now": AT}
    fields.update(overrides)
    choice = fields.pop("choice")
    reason = fields.pop("reason")
    return new_decision("b1", choice, reason, **fields)


def test_a_decision_round_trips_and_says_who_when_what_and_why(batch):
    decision = approval(reason="  failure rate is the flaky env  ")
    assert decision.reason == "failure rate is the flaky env"  # stripped
    assert write_review(batch, decision) == decision
    assert batch.review() == decision
    assert json.loads(batch.store.read_bytes(REVIEW_RECORD)) == {
        "batch_id": "b1",
        "choice": "publish",
        "reason": "failure rate is the flaky env",
        "decided_by": "alice",
        "decided_at": AT,
        "via": "cli",
        "record_version": 2,
    }
    assert decision.describe() == "publish by alice (cli) at 2026-09-21T14:13:20Z: failure rate is the flaky env"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"reason": ""}, "needs a reason"),
        ({"reason": "   "}, "needs a reason"),
        ({"reason": None}, "needs a reason"),
        ({"choice": "approve"}, "unknown review choice 'approve'"),
        ({"decided_by": ""}, "decided_by must name who decided"),
        ({"via": "timeout"}, "not timeout"),
        ({"via": "validation"}, "not validation"),
        ({"via": "email"}, "via must be one of"),
        ({"reason": "x" * 2001}, "reason has 2001 characters; at most 2000"),
    ],
)
def test_bad_input_from_a_person_is_a_review_input_error_naming_what_is_wrong(change, named):
    with pytest.raises(ReviewInputError, match=named):
        approval(**change)


def test_a_timeout_rejects_with_its_reason_and_names_nobody(batch):
    decision = timeout_decision("b1", now=AT)
    assert (decision.choice, decision.reason, decision.decided_by, decision.via) == (
        "reject",
        TIMEOUT_REASON,
        None,
        "timeout",
    )
    assert decision.describe().startswith("reject nobody answered (timeout) at ")
    with pytest.raises(ValueError, match="a timeout rejects with reason 'review_timeout'"):
        ReviewDecision(batch_id="b1", choice="publish", reason="r", decided_by=None, decided_at=AT, via="timeout")


def test_publish_own_record_publishes_without_review_and_names_nobody(batch):
    decision = unreviewed_decision("b1", now=AT)
    assert (decision.choice, decision.reason, decision.decided_by, decision.via) == (
        "publish",
        NO_REVIEW_REASON,
        None,
        "validation",
    )
    assert decision.approved and decision.unreviewed and not approval().unreviewed
    assert decision.describe() == "publish without review at 2026-09-21T14:13:20Z: no_review_needed (no suite warned)"
    assert write_review(batch, decision) == decision and batch.review() == decision
    for change in ({"choice": "reject"}, {"reason": "looked fine"}, {"decided_by": "alice"}):
        fields = {"choice": "publish", "reason": NO_REVIEW_REASON, "decided_by": None} | change
        with pytest.raises(ValueError, match="publish's own record publishes with reason 'no_review_needed'"):
            ReviewDecision(batch_id="b1", decided_at=AT, via="validation", **fields)


def test_the_first_decision_stands(batch):
    first = approval(choice="reject", reason="rewards look wrong")
    assert write_review(batch, first) == first
    second = approval(decided_by="bob")
    assert write_review(batch, second) == first
    assert batch.review() == first


@pytest.mark.parametrize(
    ("mutate", "named"),
    [
        (lambda raw: raw.update(choice="maybe"), r"choice must be one of \['publish', 'reject'\]"),
        (lambda raw: raw.pop("decided_by"), r"missing field\(s\) \['decided_by'\]"),
        (lambda raw: raw.update(extra=1), r"unknown field\(s\) \['extra'\]"),
        (lambda raw: raw.update(reason=""), "reason must be a non-empty text"),
        (lambda raw: raw.update(decided_at="yesterday"), "decided_at must be seconds since the epoch"),
        (lambda raw: raw.update(record_version=3), r"record_version 3 is not supported \(this code reads \[1, 2\]\)"),
        (lambda raw: raw.update(record_version=True), "record_version True is not supported"),
        (lambda raw: raw.update(batch_id="other"), "the decision is on batch 'other', not 'b1'"),
    ],
)
def test_a_corrupted_record_on_storage_is_refused_naming_the_file_and_field(batch, mutate, named):
    raw = json.loads(approval().to_json())
    mutate(raw)
    batch.store.write_once(REVIEW_RECORD, json.dumps(raw).encode())
    with pytest.raises(MalformedReviewError, match=named) as caught:
        batch.review()
    assert "reports/review.json" in str(caught.value) and caught.value.reason == "malformed_review"


def test_a_record_that_is_not_json_is_refused(batch):
    batch.store.write_once(REVIEW_RECORD, b"{publish")
    with pytest.raises(MalformedReviewError, match=r"review\.json is not valid JSON"):
        batch.review()
