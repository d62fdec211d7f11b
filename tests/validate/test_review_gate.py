"""A batch that validation warned about is published only after a review decision, recorded once.

Real GX runs on a guess_number batch generated with the fake scripted engine (no vLLM): shard 1's
marker is removed, so the partial dataset makes both suites warn. The library, the
``rollout-ledger publish --approve/--reject`` command and ``status`` are driven on copies of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.cli.main import main
from tasks.errors import EXIT_CONFLICT, EXIT_FAILED, EXIT_USAGE, PublishRefusedError, ReviewConflictError
from tasks.finalize.stage import FinalizeOptions
from tasks.layout import REVIEW_RECORD
from tasks.pipeline import decide_and_report, finalize_and_publish, run_suite
from tasks.publish import publish_batch
from tasks.records.review import ReviewDecision, new_decision
from tasks.status.gather import batch_status
from tasks.status.render import render_status
from tasks.storage.dataset_manifest import read_dataset_marker
from tests.local_batch import LocalBatch, copy_batch

NO_AUDIT = FinalizeOptions(audit=False)


@pytest.fixture(scope="module")
def warned_batch(generated_batch: LocalBatch, tmp_path_factory: pytest.TempPathFactory) -> LocalBatch:
    """Finalized without shard 1 and validated: both suites warned, so publish waits for a decision."""
    batch = copy_batch(generated_batch, tmp_path_factory.mktemp("warned"))
    (batch.dir / layout.shard_marker(1)).unlink()
    with pytest.raises(PublishRefusedError) as refused:
        finalize_and_publish(batch.handle, FinalizeOptions(audit=False, allow_partial=True))
    assert refused.value.reason == "review_required"
    return batch


def decision(batch: LocalBatch, choice: str, reason: str = "read the report", by: str = "alice") -> ReviewDecision:
    return new_decision(batch.batch_id, choice, reason, decided_by=by, via="cli")


def cli(batch: LocalBatch, *args: str) -> list[str]:
    return ["publish", "--root", str(batch.root), "--batch-id", batch.batch_id, *args]


def test_a_warned_batch_waits_and_an_approval_is_published_in_the_manifest_and_the_card(warned_batch, tmp_path):
    batch = copy_batch(warned_batch, tmp_path)
    root = str(batch.root)
    with pytest.raises(PublishRefusedError, match=r"needs review .* the lineage suite warned \(all_shards_committed\)"):
        publish_batch(Batch.open(root, batch.batch_id))
    waiting = batch_status(Batch.open(root, batch.batch_id))
    assert (waiting.dataset.state, waiting.dataset.review) == ("awaiting_review", None)
    assert "--approve --reason" in waiting.next_step

    approval = decision(batch, "publish", "partial on purpose: shard 1 is a known bad node")
    assert decide_and_report(Batch.open(root, batch.batch_id), approval) == approval
    assert b"approved" in batch.store.read_bytes(layout.REPORTS_INDEX)  # the overview page says so
    published = publish_batch(Batch.open(root, batch.batch_id))
    assert published.created and published.marker.review == approval
    assert read_dataset_marker(batch.store).review == approval  # type: ignore[union-attr]
    assert json.loads(batch.store.read_bytes(layout.DATASET_MARKER))["review"]["decided_by"] == "alice"
    card = batch.store.read_bytes(layout.DATASET_CARD).decode()
    assert "## Review" in card and "partial on purpose: shard 1 is a known bad node" in card and "`alice`" in card
    assert "| lineage | warned | `all_shards_committed` |" in card
    status = batch_status(Batch.open(root, batch.batch_id))
    assert status.dataset.state == "published" and status.dataset.review == approval
    assert f"  review: {approval.describe()}" in render_status(status)


def test_a_rejected_batch_is_never_published_and_the_decision_cannot_change(warned_batch, tmp_path):
    batch = copy_batch(warned_batch, tmp_path)
    root = str(batch.root)
    rejection = decision(batch, "reject", "rewards are suspicious")
    assert decide_and_report(Batch.open(root, batch.batch_id), rejection) == rejection
    assert batch.handle.review() == rejection
    for _ in range(2):
        with pytest.raises(PublishRefusedError, match=r"rejected .* a rejected batch is never published") as refused:
            publish_batch(Batch.open(root, batch.batch_id))
        assert refused.value.reason == "rejected"
    with pytest.raises(ReviewConflictError, match=r"already decided \(reject by alice"):
        decide_and_report(Batch.open(root, batch.batch_id), decision(batch, "publish", by="bob"))
    assert (
        decide_and_report(Batch.open(root, batch.batch_id), decision(batch, "reject", by="bob")) == rejection
    )  # first stands
    assert not batch.store.exists(layout.DATASET_MARKER) and not batch.store.exists(layout.DATASET_CARD)
    status = batch_status(Batch.open(root, batch.batch_id))
    assert status.dataset.state == "rejected"
    assert status.next_step.startswith("nothing to run: the batch was rejected (reject by alice (cli)")


def test_the_command_decides_through_the_same_record_and_names_bad_input(warned_batch, tmp_path, capsys):
    approved, rejected = copy_batch(warned_batch, tmp_path / "a"), copy_batch(warned_batch, tmp_path / "r")

    assert main(cli(approved)) == EXIT_FAILED
    assert "needs review before it is published" in capsys.readouterr().err
    assert main(cli(approved, "--approve")) == EXIT_USAGE
    assert "a decision to publish needs a reason" in capsys.readouterr().err
    assert main(cli(approved, "--reason", "why")) == EXIT_USAGE
    assert "--reason and --by go with --approve or --reject" in capsys.readouterr().err

    assert main(cli(approved, "--approve", "--reason", "fine for training", "--by", "carol")) == 0
    out = json.loads(capsys.readouterr().out)
    recorded = approved.handle.review()
    assert recorded is not None and out["published"] and out["review"] == json.loads(recorded.to_json())
    assert (recorded.choice, recorded.decided_by, recorded.via) == ("publish", "carol", "cli")
    assert read_dataset_marker(approved.store).review == recorded  # type: ignore[union-attr]

    assert main(cli(rejected, "--reject", "--reason", "  ")) == EXIT_USAGE
    assert "a decision to reject needs a reason" in capsys.readouterr().err
    assert main(cli(rejected, "--reject", "--reason", "truncated episodes")) == 0
    assert json.loads(capsys.readouterr().out)["published"] is False
    assert main(cli(rejected, "--approve", "--reason", "second thoughts")) == EXIT_CONFLICT
    assert "already decided (reject by" in capsys.readouterr().err
    assert main(cli(rejected)) == EXIT_FAILED
    assert "a rejected batch is never published" in capsys.readouterr().err
    assert main(["status", "--root", str(rejected.root), "--batch-id", rejected.batch_id]) == 0
    assert "review: reject by " in capsys.readouterr().out


def test_a_corrupted_review_record_is_named_by_publish_and_status(warned_batch, tmp_path, capsys):
    batch = copy_batch(warned_batch, tmp_path)
    batch.store.write_once(REVIEW_RECORD, b'{"choice": "publish"}')
    assert main(cli(batch)) == EXIT_CONFLICT
    err = capsys.readouterr().err
    assert "reports/review.json: missing field(s)" in err and "Traceback" not in err
    status = batch_status(batch.handle)
    assert status.dataset.state == "unreadable" and "MalformedReviewError" in (status.dataset.error or "")
    assert not batch.store.exists(layout.DATASET_MARKER)


def test_an_approval_does_not_override_a_failed_suite(warned_batch, tmp_path):
    from tasks.config import ValidationSpec

    batch = copy_batch(warned_batch, tmp_path)
    assert run_suite("dataset", batch.handle, thresholds=ValidationSpec(reward_min=5.0)).status == ("failed")
    with pytest.raises(PublishRefusedError, match="the dataset suite failed") as refused:
        decide_and_report(batch.handle, decision(batch, "publish"))
    assert refused.value.reason == "validation_failed"
    assert not batch.store.exists(REVIEW_RECORD)


def test_review_can_be_required_of_a_batch_both_suites_passed(generated_batch, tmp_path: Path):
    batch = copy_batch(generated_batch, tmp_path)
    root = str(batch.root)
    finalize_and_publish(Batch.open(root, batch.batch_id), NO_AUDIT, publish=False)
    run_suite("dataset", Batch.open(root, batch.batch_id))
    with pytest.raises(PublishRefusedError, match=r"needs review .* the run requires review") as refused:
        publish_batch(Batch.open(root, batch.batch_id), require_review=True)
    assert refused.value.reason == "review_required"
    decide_and_report(Batch.open(root, batch.batch_id), decision(batch, "publish"))
    assert publish_batch(Batch.open(root, batch.batch_id), require_review=True).marker.review is not None


def test_the_review_form_shows_why_the_numbers_each_warning_and_the_report_link(warned_batch, tmp_path):
    from tasks.orchestration.review_form import build_review_request

    batch = copy_batch(warned_batch, tmp_path)
    request = build_review_request(
        batch.handle, require_review=False, report_url="/rollout-ledger/x/reports/", timeout_hours=24
    )
    assert request.needed == (
        "the lineage suite warned (all_shards_committed)",
        "the dataset suite warned (dataset_complete)",
    )
    assert (request.decision, request.published) == (None, False)
    body = request.body
    assert "[Open the validation report](/rollout-ledger/x/reports/)" in body
    assert f"| rows (trainable / masked) | {batch.config.num_rollouts // 2} (" in body  # one shard of two
    assert "| lineage suite | warned |" in body and "| missing shards (partial dataset) | 1 |" in body
    assert "| lineage | `all_shards_committed` | 0.5 | – | 1 |" in body  # observed: 1 of 2 shards uncommitted
    assert "within 24 hours the batch is rejected (`review_timeout`)" in body
    decide_and_report(batch.handle, decision(batch, "reject"))
    decided = build_review_request(batch.handle, require_review=False, report_url="", timeout_hours=1)
    assert decided.decision is not None and decided.decision.choice == "reject"
