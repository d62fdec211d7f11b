"""The dataset suite fails each expectation on a staged dataset corrupted to violate it, naming the offending rows.

One finalized batch has its first part rewritten (manifest resealed: the writer vouches for the
bad rows) with one corruption per rollout or group, and is validated once; the drop-mode group
rule is shown on a corrupted profile. The per-row profile is checked against hand-made rows.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from tasks import layout
from tasks.config import ValidationSpec
from tasks.errors import SchemaMismatchError, SegmentChecksumMismatchError
from tasks.records.dataset_row import DatasetRow
from tasks.storage.dataset_manifest import read_staged_marker
from tasks.validate import SuiteOutcome, dataset_profile, validate_dataset
from tasks.validate.dataset_profile import (
    group_profile,
    part_batches,
    profile_dataset,
    row_profile,
    verified_weights,
)
from tasks.validate.gx_run import run_gx_suite
from tasks.validate.suites import dataset_suite
from tests.local_batch import LocalBatch, copy_batch

from .batches import StagedDataset, row_of

VERIFIED, OTHER = "ab" * 32, "cd" * 32
THRESHOLDS = ValidationSpec(max_invalid_row_rate=0.0, reward_min=0.0, reward_max=1.0)
EXPECTED = {
    "token_list_lengths_equal": {"r000000-00"},
    "trainable_rows_have_sampled_tokens": {"r000001-00"},
    "logprobs_finite": {"r000001-01"},
    "sampled_logprobs_not_positive": {"r000002-00"},
    "carried_logprobs_zero": {"r000002-01"},
    "rewards_within_bounds": {"r000002-02"},
    "advantages_finite": {"r000003-00"},
    "group_rollouts_equal_group_size": {"g000003"},
    "group_advantage_mean_near_zero": {"g000004"},
    "masked_rows_have_zero_advantage": {"r000005-00"},
    "mask_reason_iff_masked": {"r000005-01"},
    "row_weights_within_batch": {"r000005-02"},  # a warning: the only expectation of EXPECTED that is one
    "invalid_row_rate": {"r000003-01", "r000005-00"},
}


def corrupt(rows: list[dict]) -> None:
    """One violation per rollout (or group) of EXPECTED; groups 3-5 get rewards that leave their means unchecked."""
    for row in rows:
        if row["group_id"] in ("g000003", "g000005"):
            row["reward"] = 1.0  # equal rewards: no signal, the group mean is not checked
    row_of(rows, "r000000-00")["loss_mask"].pop()
    no_sample = row_of(rows, "r000001-00")
    no_sample["loss_mask"] = [0] * len(no_sample["loss_mask"])
    no_sample["logprobs"] = [0.0] * len(no_sample["logprobs"])
    sampled = row_of(rows, "r000001-01")["loss_mask"].index(1)
    row_of(rows, "r000001-01")["logprobs"][sampled] = math.nan
    sampled = row_of(rows, "r000002-00")["loss_mask"].index(1)
    row_of(rows, "r000002-00")["logprobs"][sampled] = 0.5
    row_of(rows, "r000002-01")["logprobs"][0] = -0.1  # the first token is the carried prompt
    row_of(rows, "r000002-02")["reward"] = 5.0
    row_of(rows, "r000003-00")["advantage"] = math.inf
    rows.remove(row_of(rows, "r000003-01"))
    for rollout, reward in (("r000004-00", 0.0), ("r000004-01", 1.0), ("r000004-02", 1.0)):
        row_of(rows, rollout).update(reward=reward, advantage=1.0)
    row_of(rows, "r000005-00").update(sample_mask=0, mask_reason="capture_poisoned", advantage=0.5)
    row_of(rows, "r000005-01").update(mask_reason="rollout_failed")
    row_of(rows, "r000005-02")["weights_by_version"][0]["weights_sha256"] = "cd" * 32  # the batch verified none


@pytest.fixture(scope="module")
def corrupted(finalized_batch: LocalBatch, tmp_path_factory: pytest.TempPathFactory) -> SuiteOutcome:
    batch = copy_batch(finalized_batch, tmp_path_factory.mktemp("dataset-corrupted"))
    StagedDataset(batch).edit(corrupt)
    return validate_dataset(batch.handle, thresholds=THRESHOLDS)


def test_the_corrupted_dataset_fails_exactly_the_violated_expectations(corrupted):
    assert {e.name for e in corrupted.summary.expectations if not e.success} == set(EXPECTED)
    passed = [e.name for e in corrupted.summary.expectations if e.success]
    # the off-policy gate's expectations pass: this batch was finalized without the logprob audit (nothing measured)
    assert passed[0] == "dataset_complete" and all(name.startswith("off_policy_") for name in passed[1:])
    counts = corrupted.summary.counts
    assert corrupted.status == "failed" and (counts.failed, counts.warned) == (len(EXPECTED) - 1, 1)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_violated_expectation_names_its_offending_rows(corrupted, name):
    (found,) = [e for e in corrupted.summary.expectations if e.name == name]
    assert not found.success and found.error is None
    assert set(found.examples) == EXPECTED[name]
    assert found.unexpected_count == len(EXPECTED[name])


def test_the_invalid_row_rate_is_observed_over_planned_rollouts(corrupted, finalized_batch):
    (rate,) = [e for e in corrupted.summary.expectations if e.name == "invalid_row_rate"]
    assert rate.observed == pytest.approx(2 / finalized_batch.config.num_rollouts)
    assert rate.threshold == 0.0


def test_drop_mode_refuses_a_group_with_more_rows_than_planned(finalized_batch, tmp_path):
    store, config = finalized_batch.store, finalized_batch.config
    tables = profile_dataset(finalized_batch.handle, read_staged_marker(store))
    groups = tables["groups"].to_pylist()
    groups[1]["rollouts"] = config.group_size + 1
    tables["groups"] = pa.Table.from_pylist(groups, schema=tables["groups"].schema)
    results = run_gx_suite(
        dataset_suite(ValidationSpec(), on_invalid="drop"), tables, site_dir=tmp_path / "docs", run_name="run-000"
    )
    assert {name for name, r in results.items() if not r.success} == {"group_rollouts_within_group_size"}
    assert results["group_rollouts_within_group_size"].examples == (groups[1]["group_id"],)


def test_the_profile_is_the_same_whatever_the_batch_size(finalized_batch, monkeypatch):
    store = finalized_batch.store
    manifest = read_staged_marker(store)
    whole = profile_dataset(finalized_batch.handle, manifest)
    monkeypatch.setattr(dataset_profile, "BATCH_ROWS", 2)
    assert [len(b) for b in part_batches(store, manifest.parts[0])][:2] == [2, 2]
    assert profile_dataset(finalized_batch.handle, manifest)["rows"].equals(whole["rows"])


def test_a_part_whose_bytes_the_manifest_does_not_name_is_refused(finalized_batch, tmp_path):
    batch = copy_batch(finalized_batch, tmp_path)
    path = batch.dir / layout.dataset_part(0)
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    with pytest.raises(SegmentChecksumMismatchError, match=r"has sha256 [0-9a-f]{64}, the dataset marker names"):
        next(part_batches(batch.store, read_staged_marker(batch.store).parts[0]))


def test_a_part_whose_schema_is_not_the_dataset_row_schema_is_refused(finalized_batch, tmp_path):
    batch = copy_batch(finalized_batch, tmp_path)
    dataset = StagedDataset(batch)
    rows = pa.Table.from_pylist(dataset.rows(), schema=DatasetRow.arrow_schema())
    dataset.write(rows.drop_columns(["num_turns"]))  # resealed: only the schema is wrong
    with pytest.raises(SchemaMismatchError, match="num_turns"):
        next(part_batches(batch.store, read_staged_marker(batch.store).parts[0]))


def test_row_profile_counts_tokens_per_row_and_leaves_unpaired_rows_unmeasured():
    rows = [
        # rollout, loss_mask, logprobs, advantage
        ("r0", [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25], 0.5),
        ("r1", [0, 1, 1], [0.3, np.nan, 0.2], math.inf),
        ("r2", [0, 1], [0.0], 0.0),  # lengths differ: no token pairs them
        ("r3", [], [], 0.0),
    ]
    schema = DatasetRow.arrow_schema()
    part = pa.table(
        {
            "rollout_id": [r[0] for r in rows],
            "group_id": ["g0"] * len(rows),
            "input_ids": pa.array([list(range(len(r[1]))) for r in rows], schema.field("input_ids").type),
            "loss_mask": pa.array([r[1] for r in rows], schema.field("loss_mask").type),
            "logprobs": pa.array([r[2] for r in rows], schema.field("logprobs").type),
            "sample_mask": pa.array([1, 1, 1, 0], pa.uint8()),
            "mask_reason": [None, None, None, "missing_receipt"],
            "advantage": [r[3] for r in rows],
            "reward": [1.0, 0.0, 0.0, None],
            "group_size": pa.array([4] * len(rows), pa.int32()),
            "weights_by_version": pa.array(
                [
                    [{"weight_version": 0, "weights_sha256": VERIFIED}],  # the batch's sha256 of version 0
                    [{"weight_version": 0, "weights_sha256": VERIFIED}, {"weight_version": 1, "weights_sha256": OTHER}],
                    [{"weight_version": 1, "weights_sha256": None}],  # declared, not verified: claims nothing
                    [],
                ],
                schema.field("weights_by_version").type,
            ),
        }
    )
    profile = row_profile(part, {0: VERIFIED}).to_pydict()
    assert profile["input_ids_len"] == [4, 3, 2, 0] and profile["logprobs_len"] == [4, 3, 1, 0]
    assert profile["sampled_tokens"] == [2, 2, None, 0]
    assert profile["nonfinite_logprobs"] == [0, 1, None, 0]
    assert profile["positive_sampled_logprobs"] == [0, 1, None, 0]
    assert profile["nonzero_carried_logprobs"] == [0, 1, None, 0]
    assert profile["advantage_finite"] == [True, False, True, True]
    assert profile["weights_within_batch"] == [True, False, True, True]


def test_only_the_versions_the_batch_verified_are_a_rows_to_name():
    by_version = {
        "2": {"calls": 9, "weights": "verified", "weights_sha256": VERIFIED},
        "3": {"calls": 2, "weights": "declared, not verified", "weights_sha256": None, "why": "not hashed"},
    }
    assert verified_weights({"weights_by_version": by_version}) == {2: VERIFIED}
    assert verified_weights({}) == {}  # metrics written before versions were judged


def test_a_group_counts_rollouts_once_however_many_rows_each_has():
    """Under independent calls a rollout has a row per call, each with the rollout's reward and advantage."""
    rows = pa.table(
        {
            "group_id": ["g0"] * 5 + ["g1"],
            "rollout_id": ["r0", "r0", "r0", "r1", "r2", "r3"],
            "sample_mask": [1, 1, 1, 1, 0, 1],
            "advantage": [1.0, 1.0, 1.0, -1.0, 0.0, 0.0],
            "reward": [1.0, 1.0, 1.0, 0.0, 0.0, 1.0],
            "group_size": [3, 3, 3, 3, 3, 3],
        }
    )
    groups = group_profile(rows).sort_by("group_id").to_pylist()
    # g0: three rollouts with rows; its trainable rollouts' advantages (1, -1) average 0 however
    # many rows r0 has; g1's single trainable rollout leaves the mean unchecked
    assert groups == [
        {"group_id": "g0", "rollouts": 3, "group_size": 3, "advantage_mean": 0.0},
        {"group_id": "g1", "rollouts": 1, "group_size": 3, "advantage_mean": None},
    ]
