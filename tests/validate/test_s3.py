"""Both suites on a batch that lives in S3 (moto's real S3 server): reports and summaries land in the bucket."""

from __future__ import annotations

import pytest

from tasks.batch import Batch
from tasks.validate import validate_dataset, validate_lineage
from tests.local_batch import LocalBatch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_both_suites_validate_a_batch_in_s3_and_write_their_reports_there(
    finalized_batch: LocalBatch, s3_endpoint, s3_bucket
):
    import s3fs

    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing", "skip_instance_cache": True}
    fs = s3fs.S3FileSystem(**options)
    root = f"{s3_bucket}/runs"
    fs.put(f"{finalized_batch.root}/", f"{root}/", recursive=True)
    batch = Batch.open(root, finalized_batch.batch_id, options)
    store = batch.store
    for suite, validate in (("lineage", validate_lineage), ("dataset", validate_dataset)):
        outcome = validate(batch)
        assert (outcome.status, outcome.created) == ("passed", True), suite
        assert outcome.report_url == f"{root}/batches/{finalized_batch.batch_id}/reports/{suite}/run-000/index.html"
        assert store.exists(outcome.summary.report) and store.exists(outcome.summary_path)
        assert batch.suite_summary(suite) == outcome.summary
        again = validate(batch)
        assert again.created is False and again.summary == outcome.summary
