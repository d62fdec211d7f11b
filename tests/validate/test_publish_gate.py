"""Publish is gated on both suites: the pipeline, the publish stage and their commands on real GX runs.

A suite that warned gates publish on a review decision: ``test_review_gate.py``.
"""

from __future__ import annotations

import json

import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.cli.main import main
from tasks.config import ValidationSpec
from tasks.errors import EXIT_FAILED, PublishRefusedError, ValidationFailedError
from tasks.finalize.stage import FinalizeOptions
from tasks.pipeline import finalize_and_publish, run_suite
from tasks.publish import publish_batch
from tasks.storage.dataset_manifest import read_dataset_marker, read_staged_marker
from tasks.trainer.collate import PublishedDataset
from tests.local_batch import LocalBatch, copy_batch

NO_AUDIT = FinalizeOptions(audit=False)
IMPOSSIBLE_REWARDS = ValidationSpec(reward_min=5.0)  # guess_number rewards are 0 or 1: the dataset suite fails


def test_a_clean_batch_is_validated_published_and_loadable(generated_batch: LocalBatch, tmp_path):
    batch = copy_batch(generated_batch, tmp_path)
    result = finalize_and_publish(batch.handle, NO_AUDIT)
    assert {suite: o.status for suite, o in result.suites.items()} == {"lineage": "passed", "dataset": "passed"}
    published = result.published
    assert published is not None and published.created
    store = batch.store
    committed = read_dataset_marker(store)
    assert committed is not None and committed.validation is not None
    assert {s: v["status"] for s, v in committed.validation.items()} == {"lineage": "passed", "dataset": "passed"}
    assert committed.parts == read_staged_marker(store).parts  # type: ignore[union-attr]
    page = store.read_bytes(f"{layout.REPORTS_DIR}/index.html").decode()
    header = page[page.index("<header>") : page.index("</header>")]
    assert ">published<" in header and ">staged<" not in header  # rewritten after publish
    assert len(PublishedDataset.from_url(published.url)) == batch.config.num_rollouts
    again = finalize_and_publish(batch.handle, NO_AUDIT)
    assert again.published is not None and not again.published.created


def test_publish_refuses_a_dataset_no_suite_has_validated(finalized_batch: LocalBatch, tmp_path):
    batch = copy_batch(finalized_batch, tmp_path)
    with pytest.raises(PublishRefusedError, match=r"the lineage suite has not run: run `rollout-ledger validate"):
        publish_batch(batch.handle)
    run_suite("lineage", batch.handle)
    with pytest.raises(PublishRefusedError, match="the dataset suite has not run"):
        publish_batch(batch.handle)
    assert not batch.store.exists(layout.DATASET_MARKER)


def test_publish_refuses_a_batch_that_was_never_finalized(generated_batch: LocalBatch, tmp_path):
    batch = copy_batch(generated_batch, tmp_path)
    with pytest.raises(PublishRefusedError, match=r"no staged dataset .* run `rollout-ledger finalize`"):
        publish_batch(batch.handle)


def test_a_failed_dataset_suite_publishes_nothing_and_says_why(generated_batch: LocalBatch, tmp_path):
    batch = copy_batch(generated_batch, tmp_path)
    with pytest.raises(ValidationFailedError, match=r"dataset suite failed the batch: rewards_within_bounds \(r"):
        finalize_and_publish(batch.handle, NO_AUDIT, thresholds=IMPOSSIBLE_REWARDS)
    store = batch.store
    assert read_staged_marker(store) is not None, "the staged dataset stays for people to inspect"
    assert not store.exists(layout.DATASET_MARKER)
    page = store.read_bytes(f"{layout.REPORTS_DIR}/index.html").decode()
    assert "rewards_within_bounds" in page
    with pytest.raises(PublishRefusedError, match=r"the dataset suite failed \(rewards_within_bounds\)"):
        publish_batch(batch.handle)
    with pytest.raises(FileNotFoundError):
        PublishedDataset.from_url(f"{batch.root}/batches/{batch.batch_id}")


def test_the_commands_exit_1_with_the_violated_expectations_and_publish_nothing(generated_batch, tmp_path, capsys):
    batch = copy_batch(generated_batch, tmp_path)
    root = str(batch.root)
    args = ["--root", root, "--batch-id", batch.batch_id]
    code = main(["finalize", *args, "--no-audit", "--threshold", "reward_min=5"])
    err = capsys.readouterr().err
    assert code == EXIT_FAILED and "rewards_within_bounds" in err and "Traceback" not in err
    assert main(["validate", *args, "--suite", "dataset", "--threshold", "reward_min=5"]) == EXIT_FAILED
    assert json.loads(capsys.readouterr().out) == {"dataset": "failed"}
    assert main(["publish", *args]) == EXIT_FAILED
    assert "dataset suite failed" in capsys.readouterr().err
    assert main(["validate", *args]) == 0  # the plan's own thresholds: both pass
    assert main(["publish", *args]) == 0
    assert batch.store.exists(layout.DATASET_MARKER)


def test_an_unknown_threshold_is_a_usage_error(generated_batch: LocalBatch, tmp_path, capsys):
    batch = copy_batch(generated_batch, tmp_path)
    code = main(["validate", "--root", str(batch.root), "--batch-id", batch.batch_id, "--threshold", "max_fun=1"])
    assert code == 2 and "unknown validation threshold(s) ['max_fun']" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_whole_pipeline_validates_and_publishes_a_batch_in_s3(generated_batch: LocalBatch, s3_endpoint, s3_bucket):
    import s3fs

    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing", "skip_instance_cache": True}
    root = f"{s3_bucket}/runs"
    s3fs.S3FileSystem(**options).put(f"{generated_batch.root}/", f"{root}/", recursive=True)
    result = finalize_and_publish(Batch.open(root, generated_batch.batch_id, options), NO_AUDIT)
    assert result.published is not None and result.published.url.startswith("s3://")
    store = Batch.open(root, generated_batch.batch_id, options).store
    assert read_dataset_marker(store) == result.published.marker
    assert store.exists(f"{layout.REPORTS_DIR}/index.html")
    assert len(PublishedDataset.from_url(result.published.url, storage_options=options)) == 18


def test_validating_a_batch_that_was_never_finalized_is_a_usage_error(generated_batch: LocalBatch, tmp_path, capsys):
    batch = copy_batch(generated_batch, tmp_path)
    code = main(["validate", "--root", str(batch.root), "--batch-id", batch.batch_id, "--suite", "dataset"])
    err = capsys.readouterr().err
    assert code == 2 and "no staged dataset; run `rollout-ledger finalize` first" in err and "Traceback" not in err
