"""A rejection racing a publish that needs no review leaves exactly one outcome, whatever the interleaving.

Both operations decide through the create-once ``reports/review.json`` (docs/validation.md, review
section). Each test forces one interleaving: the other operation runs to its end just before a chosen
write of the first (the moment after its checks, before its write), through a seam on the real
``ObjectStore.write_once``. The batch is a clean guess_number batch (fake scripted engine, both suites
passed with real GX), on local disk and on the moto S3 server. Readers asked afterwards: ``status``,
publish itself (run again) and the Airflow review task's request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.errors import PublishRefusedError, ReviewConflictError
from tasks.layout import REVIEW_RECORD
from tasks.orchestration.review_form import build_review_request
from tasks.pipeline import run_suite
from tasks.publish import publish_batch, record_decision
from tasks.records.review import new_decision
from tasks.status.gather import batch_status
from tasks.storage.objects import ObjectStore
from tests.local_batch import LocalBatch, copy_batch


@pytest.fixture(scope="module")
def validated_batch(finalized_batch: LocalBatch, tmp_path_factory: pytest.TempPathFactory) -> LocalBatch:
    """Finalized and both suites passed: publish needs no review."""
    batch = copy_batch(finalized_batch, tmp_path_factory.mktemp("validated"))
    for suite in ("lineage", "dataset"):
        assert run_suite(suite, batch.handle).status == "passed"
    return batch


@dataclass(frozen=True)
class Place:
    """A batch to race on: its root URL, id and storage options."""

    root: str
    batch_id: str
    options: dict[str, Any] | None

    @property
    def batch(self) -> Batch:
        return Batch.open(self.root, self.batch_id, self.options)


@pytest.fixture(params=["local", "s3"])
def place(request, validated_batch: LocalBatch, tmp_path) -> Place:
    if request.param == "local":
        return Place(str(copy_batch(validated_batch, tmp_path).root), validated_batch.batch_id, None)
    import s3fs

    endpoint = request.getfixturevalue("s3_endpoint")
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "skip_instance_cache": True}
    root = f"{request.getfixturevalue('s3_bucket')}/runs"
    s3fs.S3FileSystem(**options).put(f"{validated_batch.root}/", f"{root}/", recursive=True)
    return Place(root, validated_batch.batch_id, options)


def run_before_write(monkeypatch: pytest.MonkeyPatch, path: str, other: Callable[[], None]) -> list[str]:
    """Make ``other`` run to its end just before the first ``write_once`` of ``path``; returns the paths it wrote."""
    original = ObjectStore.write_once
    armed = [True]
    order: list[str] = []

    def write_once(self: ObjectStore, relative: str, data: bytes):
        if armed[0] and relative == path:
            armed[0] = False
            other()
        order.append(relative)
        return original(self, relative, data)

    monkeypatch.setattr(ObjectStore, "write_once", write_once)
    return order


def publish(place: Place):
    return publish_batch(place.batch)


def reject(place: Place):
    rejection = new_decision(place.batch_id, "reject", "rewards look off", decided_by="alice", via="cli")
    return record_decision(place.batch, rejection)


def outcome_seen_by_every_reader(place: Place) -> str:
    """``published`` or ``rejected``: what status, publish and the review task agree on (asserted here)."""
    batch = place.batch
    store = batch.store
    state = batch_status(batch).dataset.state
    request = build_review_request(batch, require_review=False, report_url="", timeout_hours=1)
    try:
        again: str = "published" if publish(place).marker is not None else "?"
    except PublishRefusedError as refused:
        again = refused.reason
    recorded = batch.review()
    assert recorded is not None, "the slot decides: it is always filled"
    if batch.published_dataset() is not None:
        assert (state, again, request.published, recorded.choice) == ("published", "published", True, "publish")
        return "published"
    assert (state, again, request.published, recorded.choice) == ("rejected", "rejected", False, "reject")
    assert not store.exists(layout.DATASET_CARD)
    return "rejected"


def test_a_rejection_between_publish_checks_and_its_record_wins_and_publish_is_refused(place, monkeypatch):
    rejected = []
    run_before_write(monkeypatch, REVIEW_RECORD, lambda: rejected.append(reject(place)))
    with pytest.raises(PublishRefusedError, match=r"rejected while publish ran .* never published") as refused:
        publish(place)
    assert refused.value.reason == "rejected" and rejected[0].choice == "reject"
    monkeypatch.undo()
    assert outcome_seen_by_every_reader(place) == "rejected"


def test_a_rejection_between_publish_record_and_its_manifest_loses_and_publish_lands(place, monkeypatch):
    conflicts = []

    def rejection() -> None:
        with pytest.raises(ReviewConflictError, match=r"published without a review .* changes nothing") as conflict:
            reject(place)
        conflicts.append(conflict.value)

    run_before_write(monkeypatch, layout.DATASET_MARKER, rejection)
    assert publish(place).created and len(conflicts) == 1
    monkeypatch.undo()
    assert outcome_seen_by_every_reader(place) == "published"


def test_a_publish_between_rejection_checks_and_its_record_wins_and_the_rejection_is_refused(place, monkeypatch):
    published = []
    order = run_before_write(monkeypatch, REVIEW_RECORD, lambda: published.append(publish(place)))
    with pytest.raises(ReviewConflictError, match=r"published without a review .* a decision to reject"):
        reject(place)
    assert published[0].created
    assert order[0] == REVIEW_RECORD and order[-2:] == [layout.DATASET_MARKER, REVIEW_RECORD]  # publish's, then ours
    monkeypatch.undo()
    assert outcome_seen_by_every_reader(place) == "published"


@pytest.mark.parametrize("first", ["publish", "reject"])
def test_one_after_the_other_the_second_is_refused(place, first):
    if first == "publish":
        assert publish(place).created
        with pytest.raises(ReviewConflictError):
            reject(place)
    else:
        assert reject(place).choice == "reject"
        with pytest.raises(PublishRefusedError, match="rejected"):
            publish(place)
    assert outcome_seen_by_every_reader(place) == ("published" if first == "publish" else "rejected")
