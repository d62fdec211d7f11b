"""Staging: bounded Parquet parts and metrics, the staged marker last, idempotent re-runs; the card publish renders."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks import layout
from tasks.config import EngineSpec
from tasks.errors import MalformedDatasetMarkerError, ObjectConflictError, SegmentChecksumMismatchError
from tasks.finalize import dataset_writer as publish_module
from tasks.finalize.card import render_card
from tasks.finalize.dataset_writer import stage_dataset
from tasks.finalize.metrics import DatasetMetrics
from tasks.models.provenance import WEIGHTS_DECLARED
from tasks.records.dataset_row import DATASET_SCHEMA_VERSION, DatasetRow
from tasks.storage.dataset_manifest import DatasetMarker, read_dataset_part, read_staged_marker
from tasks.storage.objects import ObjectStore

from .rollouts import batch_config, mixed_groups, rows_of


def card_of(marker: DatasetMarker, metrics: dict) -> str:
    """The card publish would write for this staged dataset (both suites passed, no review)."""
    return render_card(
        batch_id=marker.batch_id,
        config=marker.config,
        metrics=metrics,
        parts=[dataclasses.asdict(p) for p in marker.parts],
        validation={"lineage": {"status": "passed", "warned": []}, "dataset": {"status": "passed", "warned": []}},
        review=None,
    )


def published_rows(store: ObjectStore) -> list[DatasetRow]:
    marker = read_staged_marker(store)
    return [row for part in marker.parts for row in DatasetRow.from_table(read_dataset_part(store, part))]


def test_publish_writes_bounded_parts_metrics_card_and_marker(store):
    config = batch_config()
    groups = mixed_groups(config)
    published = stage_dataset(store, iter(groups), config=config, rows_per_part=5)
    marker = published.marker
    assert published.created
    assert [p.path for p in marker.parts] == [layout.dataset_part(i) for i in range(3)]
    assert [p.rows for p in marker.parts] == [5, 5, 2]
    assert (marker.rows, marker.trainable_rows, marker.groups) == (12, 10, 3)
    assert marker.config["batch_id"] == config.batch_id and marker.config["on_invalid"] == "mask"
    for named in marker.files:
        assert store.size(named.path) == named.size
    rows = published_rows(store)
    assert [(r.group_id, r.rollout_id) for r in rows] == sorted((r.group_id, r.rollout_id) for r in rows)
    assert rows == [row for g in groups for row in rows_of(g)]
    assert json.loads(store.read_bytes(layout.DATASET_METRICS))["rows"] == 12


def test_marker_is_the_last_object_written(tmp_path):
    written: list[str] = []

    class RecordingStore(ObjectStore):
        def write_once(self, relative, data):
            written.append(relative)
            return super().write_once(relative, data)

    store = RecordingStore(str(tmp_path / "batch"))
    stage_dataset(store, mixed_groups(batch_config()), config=batch_config(), rows_per_part=4)
    assert written[-2:] == [layout.DATASET_METRICS, layout.DATASET_STAGED]
    assert layout.DATASET_CARD not in written  # publish writes the card


def test_published_batch_is_not_finalized_again(store):
    config = batch_config()
    first = stage_dataset(store, mixed_groups(config), config=config, now=1.0)

    def never_read():
        raise AssertionError("groups of a published batch must not be read")
        yield

    again = stage_dataset(store, never_read(), config=config, now=2.0)
    assert not again.created and again.marker == first.marker


def test_rerun_after_a_crash_before_the_marker_completes_the_dataset(tmp_path):
    store = ObjectStore(str(tmp_path / "batch"))
    config = batch_config()
    groups = mixed_groups(config)

    def crashing():
        yield from groups[:2]
        raise RuntimeError("worker died")

    with pytest.raises(RuntimeError, match="worker died"):
        stage_dataset(store, crashing(), config=config, rows_per_part=4)
    assert read_staged_marker(store) is None and store.exists(layout.dataset_part(0))
    published = stage_dataset(store, groups, config=config, rows_per_part=4)
    assert published.created and published.marker.rows == 12


def test_concurrent_publisher_that_lost_the_marker_race_returns_the_winner(tmp_path, monkeypatch):
    store = ObjectStore(str(tmp_path / "batch"))
    config = batch_config()
    winner = stage_dataset(store, mixed_groups(config), config=config, now=1.0)
    seen: list[ObjectStore] = []

    def stale_then_real(checked: ObjectStore):
        seen.append(checked)  # the first check runs before the winner's marker "exists"
        return None if len(seen) == 1 else read_staged_marker(checked)

    monkeypatch.setattr(publish_module, "read_staged_marker", stale_then_real)
    loser = stage_dataset(store, mixed_groups(config), config=config, now=2.0)
    assert not loser.created and loser.marker == winner.marker


def test_different_content_under_an_uncommitted_part_is_a_conflict(tmp_path):
    store = ObjectStore(str(tmp_path / "batch"))
    store.write_once(layout.dataset_part(0), b"left by another run")
    with pytest.raises(ObjectConflictError, match=r"part-00000\.parquet"):
        stage_dataset(store, mixed_groups(batch_config()), config=batch_config())


def test_groups_out_of_order_are_refused(tmp_path):
    groups = mixed_groups(batch_config())
    with pytest.raises(ValueError, match="group g000000 arrives after group g000001"):
        stage_dataset(ObjectStore(str(tmp_path)), [groups[1], groups[0]], config=batch_config())


def test_dataset_without_rows_still_has_one_loadable_part(tmp_path):
    store = ObjectStore(str(tmp_path / "batch"))
    config = batch_config(on_invalid="drop")
    marker = stage_dataset(store, [], config=config).marker
    assert [(p.path, p.rows) for p in marker.parts] == [(layout.dataset_part(0), 0)]
    assert read_dataset_part(store, marker.parts[0]).num_rows == 0


def test_drop_mode_writes_only_trainable_rows(tmp_path):
    config = batch_config(on_invalid="drop")
    store = ObjectStore(str(tmp_path / "batch"))
    marker = stage_dataset(store, mixed_groups(config), config=config).marker
    assert marker.rows == marker.trainable_rows == 10
    assert all(r.group_size == 4 for r in published_rows(store))


def test_tampered_part_fails_its_checksum(tmp_path):
    store = ObjectStore(str(tmp_path / "batch"))
    marker = stage_dataset(store, mixed_groups(batch_config()), config=batch_config()).marker
    path = tmp_path / "batch" / marker.parts[0].path
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    with pytest.raises(SegmentChecksumMismatchError, match="part-00000") as caught:
        read_dataset_part(store, marker.parts[0])
    assert caught.value.reason == "segment_checksum_mismatch"


def test_malformed_marker_is_refused_with_its_reason(tmp_path):
    store = ObjectStore(str(tmp_path / "batch"))
    store.write_once(layout.DATASET_STAGED, b'{"batch_id": "x"}')
    with pytest.raises(MalformedDatasetMarkerError, match=r"_STAGED\.json: missing field\(s\) \[.card.,") as caught:
        read_staged_marker(store)
    assert caught.value.reason == "malformed_marker"


def test_marker_round_trips_through_json(tmp_path):
    store = ObjectStore(str(tmp_path / "batch"))
    marker = stage_dataset(store, mixed_groups(batch_config()), config=batch_config()).marker
    assert read_staged_marker(store) == marker
    raw = json.loads(store.read_bytes(layout.DATASET_STAGED))
    assert raw["metrics"]["path"] == layout.DATASET_METRICS and raw["schema_version"] == DATASET_SCHEMA_VERSION == 3


def test_metrics_and_card_describe_the_batch_and_the_audit(tmp_path):
    store = ObjectStore(str(tmp_path / "batch"))
    metrics = DatasetMetrics()
    metrics.add_ledger(calls=30, token_in_calls=18, failure_reasons={"staging_write_failed": 1})
    audit = {"sampled_tokens": 40, "mean_abs_logprob_diff": 0.0012}
    marker = stage_dataset(store, mixed_groups(batch_config()), config=batch_config(), metrics=metrics, audit=audit)
    written = json.loads(store.read_bytes(layout.DATASET_METRICS))
    assert written["audit"] == audit and written["failure_reasons_by_prefix"] == {"staging": 1}
    card = card_of(marker.marker, written)
    assert "| `capture_poisoned` | 1 |" in card and "| `missing_receipt` | 1 |" in card
    assert 'load_dataset("parquet", data_files=f"{batch}/dataset/part-*.parquet"' in card
    assert "## Logprob audit" in card and "| mean_abs_logprob_diff | 0.0012 |" in card
    assert 'path: "part-*.parquet"' in card


def test_the_card_and_manifest_say_how_the_weights_are_known(tmp_path):
    verified = batch_config()
    served = dataclasses.replace(
        verified,
        model=dataclasses.replace(verified.model, weights=WEIGHTS_DECLARED),
        engine=EngineSpec("vllm_server", {"urls": ["http://gpu-7:8000"], "served_model": "policy"}),
    )
    for config, line in (
        (verified, "Weights: verified. Their sha256"),
        (served, "Weights: declared, not verified. The `vllm_server` servers"),
    ):
        store = ObjectStore(str(tmp_path / config.engine.name))
        marker = stage_dataset(store, mixed_groups(config), config=config).marker
        assert marker.config["model"]["weights"] == config.model.weights
        assert line in card_of(marker, json.loads(store.read_bytes(layout.DATASET_METRICS)))
    assert "accepted by their model name `policy`" in card_of(marker, {})


@pytest.mark.parametrize(
    ("isolation", "line"),
    [
        ("sandbox", "Agents: each agent command ran in an OS sandbox (bubblewrap)"),
        ("process", "Agents: isolation `process`: the agent commands ran as plain child processes, without an OS"),
        (None, None),
    ],
)
def test_the_card_names_how_agent_commands_were_isolated(tmp_path, isolation, line):
    config = batch_config()
    if isolation is not None:
        config = dataclasses.replace(config, environment_options={"command": ["true"], "isolation": isolation})
    store = ObjectStore(str(tmp_path / "batch"))
    card = card_of(stage_dataset(store, mixed_groups(config), config=config).marker, {})
    assert (line in card) if line else "Agents:" not in card


def test_parts_are_plain_parquet_with_the_row_schema(tmp_path):
    store = ObjectStore(str(tmp_path / "batch"))
    stage_dataset(store, mixed_groups(batch_config()), config=batch_config())
    table = pq.read_table(tmp_path / "batch" / layout.dataset_part(0))
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("weight_version_spans").type.value_type.names == [
        "call_id",
        "start",
        "end",
        "weight_version",
    ]


def test_missing_shards_are_recorded_in_the_marker_metrics_and_card(tmp_path):
    store = ObjectStore(str(tmp_path / "batch"))
    config = dataclasses.replace(batch_config(num_tasks=4), shards=4)
    marker = stage_dataset(store, mixed_groups(config), config=config, missing_shards=[1, 3]).marker
    assert (marker.partial, marker.missing_shards) == (True, (1, 3))
    assert read_staged_marker(store) == marker
    metrics = json.loads(store.read_bytes(layout.DATASET_METRICS))
    assert (metrics["partial"], metrics["missing_shards"]) == (True, [1, 3])
    assert "PARTIAL: shards [1, 3] are missing (of 4 planned)" in card_of(marker, metrics)


@pytest.mark.parametrize("missing", [[3], [1, 1], [2, 1], [-1], [True]])
def test_missing_shards_that_are_not_distinct_shards_of_the_batch_ascending_are_refused(tmp_path, missing):
    config = dataclasses.replace(batch_config(), shards=3)
    with pytest.raises(ValueError, match="missing shards"):
        stage_dataset(ObjectStore(str(tmp_path / "batch")), [], config=config, missing_shards=missing)


@pytest.mark.parametrize(
    ("partial", "missing_shards"), [(True, []), (False, [0]), (False, [5])], ids=["no-shard", "unflagged", "unplanned"]
)
def test_a_marker_whose_partial_flag_contradicts_its_missing_shards_is_refused(tmp_path, partial, missing_shards):
    store = ObjectStore(str(tmp_path / "batch"))
    stage_dataset(store, mixed_groups(batch_config()), config=batch_config())
    raw = json.loads(store.read_bytes(layout.DATASET_STAGED))
    raw.update(partial=partial, missing_shards=missing_shards)
    with pytest.raises(MalformedDatasetMarkerError, match=r"partial|missing shards"):
        DatasetMarker.from_json(json.dumps(raw))


@pytest.mark.parametrize(
    ("where", "change", "message"),
    [
        ("metrics", {"kind": "part"}, "wrong kind or rows"),
        ("card", {"rows": 3}, "wrong kind or rows"),
        ("metrics", {"kind": "receipts"}, "wrong kind or rows"),
        ("card", {"kind": "table"}, "kind must be one of"),
    ],
)
def test_the_dataset_marker_names_its_files_with_the_shard_markers_file_type(tmp_path, where, change, message):
    store = ObjectStore(str(tmp_path / "batch"))
    published = stage_dataset(store, mixed_groups(batch_config()), config=batch_config())
    assert {f.kind for f in published.marker.files} == {"part", "metrics"}  # the card is publish's
    raw = json.loads(store.read_bytes(layout.DATASET_STAGED))
    raw["card"] = {**raw["metrics"], "path": layout.DATASET_CARD, "kind": "card"}
    DatasetMarker.from_json(json.dumps(raw))  # a card named as publish names it is accepted
    raw[where].update(change)
    with pytest.raises(MalformedDatasetMarkerError, match=message):
        DatasetMarker.from_json(json.dumps(raw))
