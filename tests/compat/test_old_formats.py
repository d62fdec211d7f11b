"""Every record version this project ever wrote is read, or refused with the file, the version and the way out.

The bytes under ``old_formats/`` were written by the code of the commit each was current in
(``make_old_formats.py``). They are put where the layout puts them and read through the readers
the stages use.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.config import ValidationSpec
from tasks.errors import ConfigError, MalformedDatasetMarkerError, ReviewConflictError
from tasks.generate.console import shard_lines, summaries_json
from tasks.generate.summary import ShardSummary
from tasks.layout import REVIEW_RECORD
from tasks.lineage.datasets import generate_lineage
from tasks.publish import publish_batch, record_decision
from tasks.records.dataset_row import (
    DATASET_SCHEMA_VERSION,
    KEPT_COLUMNS,
    SAMPLING_COLUMNS,
    V1_SCHEMA,
    V2_SCHEMA,
    DatasetRow,
)
from tasks.records.ledger import CallRecord, FailureRow, Receipt, StagedDelta
from tasks.records.review import new_decision
from tasks.status.gather import batch_status
from tasks.status.render import render_status
from tasks.storage.claims import read_claims
from tasks.storage.dataset_manifest import read_dataset_marker, read_dataset_part, read_staged_marker
from tasks.storage.ledger_files import decode_ledger_file
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.marker import read_marker
from tasks.trainer.collate import GrpoCollator, PublishedDataset
from tasks.validate.dataset_profile import part_batches

OLD = Path(__file__).parent / "old_formats"
BATCH = "old-b1"  # the batch every old record names


def old(name: str) -> bytes:
    return (OLD / name).read_bytes()


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "root")


@pytest.fixture
def batch(root) -> Batch:
    return Batch.open(root, BATCH)


@pytest.fixture
def store(batch):
    return batch.store


def test_a_version_2_config_from_before_the_later_thresholds_reads_them_as_defaults(batch, store):
    store.write_once(layout.plan_config(), old("batch-config-v2-first.json"))
    assert "max_poisoned_rate" not in json.loads(old("batch-config-v2-first.json"))["validation"]
    config = batch.config
    assert (config.batch_id, config.config_version, config.model.reference) == (
        BATCH,
        2,
        "bundled:smollm2-135m-instruct",
    )
    assert config.validation == ValidationSpec()


def test_a_version_1_config_is_refused_naming_the_file_and_the_re_plan(batch, store):
    store.write_once(layout.plan_config(), old("batch-config-v1.json"))
    with pytest.raises(ConfigError) as refused:
        _ = batch.config
    message = str(refused.value)
    assert message.startswith(f"{store.url}/plan/batch.json: config_version 1 is not supported (this code reads [2])")
    assert "re-plan it under a new batch id" in message


def test_a_config_of_a_newer_version_is_refused_as_such(batch, store):
    newer = json.loads(old("batch-config-v2-first.json")) | {"config_version": 3}
    store.write_once(layout.plan_config(), json.dumps(newer).encode())
    with pytest.raises(ConfigError, match=r"config_version 3 is not supported .* written by newer code"):
        _ = batch.config


def test_the_first_shard_marker_and_attempt_claim_read_as_written(store):
    store.write_once(layout.shard_marker(0), old("shard-marker-v1.json"))
    store.write_once(layout.attempt_claim(0, 0), old("attempt-claim-first.json"))
    marker = read_marker(store, 0)
    assert marker is not None and (marker.marker_version, marker.counts.rollouts, len(marker.files)) == (1, 2, 3)
    assert marker.to_json().encode() == old("shard-marker-v1.json")  # nothing was lost or added in reading
    (claim,) = read_claims(store, 0)
    assert claim.to_json().encode() == old("attempt-claim-first.json")


def test_a_version_1_shard_reads_with_its_used_calls_unknown_in_the_marker_and_counted_by_status(root, batch, store):
    """A shard committed by version-1 code after a killed attempt (``make_old_formats.py``): its marker's
    ``counts.calls`` (5) counts every named call record, one of them diverged from, so 4 are used."""
    folder = OLD / "ledger-v1-resumed"
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            store.write_once(path.relative_to(folder).as_posix(), path.read_bytes())
    written = (folder / layout.shard_marker(0)).read_bytes()
    assert json.loads(written)["marker_version"] == 1 and json.loads(written)["counts"]["calls"] == 5
    marker = read_marker(store, 0)
    assert marker is not None and (marker.counts.calls_recorded, marker.counts.calls_used) == (5, None)
    assert marker.to_json().encode() == written  # read as written: nothing lost or added
    assert LedgerReader(store, 0).calls_used == 4  # counted from the named files

    status = batch_status(Batch.open(root, BATCH))
    (shard,) = status.shards
    assert shard.state == "committed" and shard.committed is not None
    assert (shard.committed.calls, shard.committed.counts.calls_recorded, shard.committed.counts.calls_used) == (
        4,
        5,
        None,
    )
    assert (status.totals.calls, status.totals.calls_recorded) == (4, 5)
    text = render_status(status)
    assert "1 adopted), 4 calls used, 5 recorded (used: counted from the ledger, which a version-1 marker" in text
    assert (
        "totals (1 committed shard(s)): 2/2 rollouts receipted (2 ok, 0 poisoned, 0 failed), 4 calls used, 5 " in text
    )

    summary = ShardSummary.of_marker(marker)  # generate finding the shard committed
    assert (summary.calls, summary.calls_recorded) == (None, 5)
    assert "calls used unknown (a version-1 marker), 5 recorded" in shard_lines(summary)[0]
    (as_json,) = json.loads(summaries_json([summary]))
    assert (as_json["calls"], as_json["calls_recorded"]) == (None, 5)  # null: unknown

    (ledger, _) = generate_lineage(Batch.open(root, BATCH), 0).outputs
    statistics = ledger.outputFacets["outputStatistics"]
    ledger_files = [f for f in marker.files if f.kind in layout.LEDGER_KINDS]
    assert (statistics.rowCount, statistics.size, statistics.fileCount) == (
        None,
        sum(f.size for f in ledger_files),
        len(ledger_files),
    )


def test_the_first_suite_summary_reads_as_written(batch, store):
    store.write_once(layout.suite_summary("lineage", layout.suite_run_name(0)), old("suite-summary-first.json"))
    summary = batch.suite_summary("lineage")
    assert summary is not None and (summary.status, summary.run) == ("warned", "run-000")
    assert summary.to_json().encode() == old("suite-summary-first.json")


def test_a_version_1_review_record_reads_as_version_2_with_the_same_decision(batch, store):
    store.write_once(REVIEW_RECORD, old("review-v1.json"))
    decision = batch.review()
    written = json.loads(old("review-v1.json"))
    assert written["record_version"] == 1
    assert decision is not None and json.loads(decision.to_json()) == written | {"record_version": 2}


def test_a_version_4_manifest_holding_a_version_1_review_reads_with_the_review_upgraded(store):
    store.write_once(layout.DATASET_MARKER, old("dataset-v4-committed-review-v1.json"))
    marker = read_dataset_marker(store)
    written = json.loads(old("dataset-v4-committed-review-v1.json"))
    assert marker is not None and marker.review is not None
    assert json.loads(marker.review.to_json()) == written["review"] | {"record_version": 2}
    assert json.loads(marker.to_json()) == written | {"review": written["review"] | {"record_version": 2}}


def test_a_published_version_3_manifest_reads_as_4_without_a_review_and_stays_published(root, store):
    store.write_once(layout.DATASET_MARKER, old("dataset-v3-committed.json"))
    written = json.loads(old("dataset-v3-committed.json"))
    marker = read_dataset_marker(store)
    assert marker is not None and (marker.marker_version, marker.review) == (4, None)
    assert json.loads(marker.to_json()) == written | {"marker_version": 4, "review": None}
    assert marker.validation is not None and marker.validation["lineage"]["status"] == "warned"
    again = publish_batch(Batch.open(root, BATCH))  # publishing a published batch returns its manifest
    assert not again.created and again.marker == marker
    with pytest.raises(ReviewConflictError, match="published without a review"):
        record_decision(Batch.open(root, BATCH), new_decision(BATCH, "reject", "late", decided_by="alice", via="cli"))


@pytest.mark.parametrize(
    ("name", "path", "step"),
    [
        ("dataset-v1-committed.json", layout.DATASET_MARKER, "re-plan the batch under a new batch id"),
        ("dataset-v2-committed.json", layout.DATASET_MARKER, "a dataset published without validation: copy"),
        ("dataset-v3-committed-unvalidated.json", layout.DATASET_MARKER, "a dataset published without validation"),
        ("dataset-v3-staged.json", layout.DATASET_STAGED, "a staged dataset whose card finalize wrote: copy"),
    ],
)
def test_older_dataset_manifests_are_refused_naming_the_file_version_and_the_rebuild(store, name, path, step):
    store.write_once(path, old(name))
    version = json.loads(old(name))["marker_version"]
    with pytest.raises(MalformedDatasetMarkerError) as refused:
        read_dataset_marker(store) if path == layout.DATASET_MARKER else read_staged_marker(store)
    message = str(refused.value)
    assert message.startswith(f"{store.url}/{path}: marker_version {version} is not supported (this code reads [3, 4]")
    assert step in message
    if version > 1:
        assert "run `rollout-ledger finalize --root NEW_ROOT --batch-id BATCH_ID` on the copy" in message


def test_the_parquet_schemas_are_the_ones_their_versions_were_first_written_with():
    """A change to a schema needs a new version number and a reader of the old one (or, for a column
    added to the ledger, the value older files' rows mean: ``column(added=...)``)."""
    ledger = "".join(
        f"{c.__name__}\n{_first_schema(c).to_string(show_schema_metadata=True)}\n"
        for c in (StagedDelta, CallRecord, FailureRow, Receipt)
    )
    assert ledger == old("ledger-schemas-v2.txt").decode(), "bump tasks/records/digest.py SCHEMA_VERSION"
    assert _added(Receipt) == {"replayed_calls": ()}
    assert _added(StagedDelta) == {"kept_counts": (), "kept_token_ids": ()}  # older calls kept no sets (52b04d1)
    assert not any(_added(c) for c in (CallRecord, FailureRow))
    assert DATASET_SCHEMA_VERSION == 3
    rows = DatasetRow.arrow_schema().to_string(show_schema_metadata=True) + "\n"
    assert rows == old("dataset-row-schema-v3.txt").decode(), "bump DATASET_SCHEMA_VERSION"
    # the schemas upgrade_rows reads as versions 1 and 2 are the ones those versions were written with
    assert V2_SCHEMA.to_string(show_schema_metadata=True) + "\n" == old("dataset-row-schema-v2.txt").decode()
    assert V1_SCHEMA.to_string(show_schema_metadata=True) + "\n" == old("dataset-row-schema-v1.txt").decode()


def _added(record_cls: type) -> dict[str, object]:
    """The columns added to ``record_cls`` after version 2 of the ledger, with the value older rows read as."""
    fields = dataclasses.fields(record_cls)
    return {f.name: f.metadata["added"] for f in fields if f.metadata["added"] is not dataclasses.MISSING}


def _first_schema(record_cls: type) -> pa.Schema:
    schema = record_cls.arrow_schema()
    for name in _added(record_cls):
        schema = schema.remove(schema.get_field_index(name))
    return schema


def test_a_receipts_file_from_before_replayed_calls_reads_with_none_replayed():
    data = old("ledger-receipts-v2/receipts-000000.parquet")
    assert pq.read_schema(pa.BufferReader(data)).names == _first_schema(Receipt).names
    (receipt,) = decode_ledger_file("receipts", data, path="ledger/shard-00000/attempt-00/receipts-000000.parquet")
    assert (receipt.rollout_id, receipt.num_calls, receipt.replayed_calls) == ("r000000-00", 1, ())


@pytest.fixture
def v1_dataset(root, store) -> str:
    """The batch URL of a published dataset of schema version 1, every file as that code wrote it."""
    for path in sorted((OLD / "dataset-rows-v1").rglob("*")):
        if path.is_file():
            store.write_once(path.relative_to(OLD / "dataset-rows-v1").as_posix(), path.read_bytes())
    return store.url


# What a version-1 row reads as: each version of its weight spans named, its weights declared, not verified.
V1_WEIGHTS = [[{"weight_version": 0, "weights_sha256": None}, {"weight_version": 1, "weights_sha256": None}], []]


def test_a_version_1_dataset_reads_with_each_rows_weights_declared_not_verified(v1_dataset, store):
    marker = read_dataset_marker(store)
    assert marker is not None and (marker.schema_version, marker.rows) == (1, 2)
    (part,) = marker.parts
    written = pq.read_table(OLD / "dataset-rows-v1" / part.path)
    assert "weights_by_version" not in written.column_names
    table = read_dataset_part(store, part)
    assert table.schema.equals(DatasetRow.arrow_schema())
    assert table.column("weights_by_version").to_pylist() == V1_WEIGHTS
    assert table.select(V1_SCHEMA.names).equals(written)  # nothing else changed
    assert all(table.column(name).null_count == 2 for name in SAMPLING_COLUMNS)  # not recorded, as in version 2
    trained, placeholder = DatasetRow.from_table(table)  # every row invariant holds
    assert [w.weight_version for w in trained.weights_by_version] == [0, 1] and placeholder.weights_by_version == ()
    (batch,) = part_batches(store, part)  # the dataset suite's reader
    assert batch.column("weights_by_version").to_pylist() == V1_WEIGHTS


def test_the_trainer_loads_a_version_1_dataset_through_its_manifest_and_from_copied_files(v1_dataset, store):
    data = PublishedDataset.from_url(v1_dataset)
    assert len(data) == 2 and data[0]["input_ids"].tolist() == list(range(100, 117))
    batch = GrpoCollator()([data[0], data[1]])
    assert batch["train_mask"].sum().item() == 9 and batch["rollout_id"] == ["r000000-00", "r000000-01"]
    copied = PublishedDataset.from_files([str(OLD / "dataset-rows-v1" / layout.dataset_part(0))])
    assert len(copied) == 2 and copied[0]["input_ids"].tolist() == data[0]["input_ids"].tolist()


@pytest.fixture
def v2_dataset(root, store) -> str:
    """The batch URL of a published dataset of schema version 2 (written by 52b04d1's code), from a batch sampled
    with top-p 0.9 / top-k 50."""
    for path in sorted((OLD / "dataset-rows-v2").rglob("*")):
        if path.is_file():
            store.write_once(path.relative_to(OLD / "dataset-rows-v2").as_posix(), path.read_bytes())
    return store.url


def test_a_version_2_dataset_reads_with_its_sampling_not_recorded_and_claims_no_mask(v2_dataset, store):
    marker = read_dataset_marker(store)
    assert marker is not None and (marker.schema_version, marker.rows) == (2, 2)
    assert (marker.config["sampling"]["top_p"], marker.config["sampling"]["top_k"]) == (0.9, 50)  # it truncated
    (part,) = marker.parts
    written = pq.read_table(OLD / "dataset-rows-v2" / part.path)
    assert written.schema.equals(V2_SCHEMA)
    for table in (read_dataset_part(store, part), *part_batches(store, part)):  # finalize's and the suite's readers
        assert table.schema.equals(DatasetRow.arrow_schema())
        assert table.select(V2_SCHEMA.names).equals(written)  # nothing else changed
        assert all(table.column(name).null_count == 2 for name in SAMPLING_COLUMNS)
        assert all(table.column(name).to_pylist() == [[], []] for name in KEPT_COLUMNS)
    trained, placeholder = DatasetRow.from_table(read_dataset_part(store, part))  # every row invariant holds
    assert trained.weights_by_version[0].weights_sha256 == "ab" * 32
    assert (trained.sampling_recorded, trained.truncates, len(trained.kept)) == (False, None, 0)
    assert not placeholder.sampling_recorded and placeholder.mask_reason == "missing_receipt"


def test_the_trainer_loads_a_version_2_dataset_with_its_sampling_not_recorded(v2_dataset):
    data = PublishedDataset.from_url(v2_dataset)
    assert len(data) == 2 and data[0]["input_ids"].tolist() == list(range(100, 117))
    assert data[0]["logprobs_mode"] is None and data[0]["kept_counts"].numel() == 0
    batch = GrpoCollator()([data[0], data[1]])
    assert batch["sampling_recorded"].tolist() == [False, False]
    assert batch["temperature"].isnan().all() and batch["kept_counts"].sum().item() == 0
    assert batch["kept_token_ids"].numel() == 0 and batch["train_mask"].sum().item() == 9
