"""The dataset suite's profile: the staged dataset as small tables of scalars, computed part by part with Arrow.

Token lists never leave Arrow and numpy: each part the manifest names is read (size and sha256
checked), decoded :data:`BATCH_ROWS` rows at a time (schema checked), and each record batch is
reduced to one row of counts and flags per dataset row before the next is decoded, so memory
holds, per part being read (:data:`PARALLEL_PARTS` at a time), its bytes and one batch, plus the
profile (decoding a part whole allocated, and faulted in, hundreds of MB per part). Tables (see
:data:`tasks.validate.suites.DATASET_TABLES`):

* ``shards``: every planned shard, ``in_dataset`` unless the manifest lists it as missing;
* ``rows``: per dataset row its three list lengths; ``sampled_tokens`` (loss_mask sum);
  ``nonfinite_logprobs``; ``positive_sampled_logprobs`` (loss_mask 1, logprob > 0);
  ``nonzero_carried_logprobs`` (loss_mask 0, logprob != 0, NaN included); the token counts are
  null for a row whose loss_mask and logprobs lengths differ (no token pairs them); and its
  scalars (sample_mask, mask_reason, advantage, ``advantage_finite``, reward, group_size);
  ``weights_within_batch``: every sha256 the row's ``weights_by_version`` names is the one the
  batch verified for that version (``weights_by_version`` of ``metrics.json``);
* ``groups``: per group its ``rollouts`` (with rows), ``group_size`` and ``advantage_mean`` over
  its trainable rollouts, null when fewer than two are trainable or their rewards are all equal
  (their advantages are 0 by definition, :mod:`tasks.finalize.advantages`);
* ``rollouts``: every planned rollout of the dataset's shards, ``trainable`` when a row of it has sample_mask 1;
* ``off_policy``: one row (``batch_id``), the off-policy gate's measures
  (:data:`tasks.finalize.off_policy.GATE_MEASURES`) from the logprob audit in ``metrics.json``, all null
  when finalize ran without the audit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.batch import Batch
from tasks.finalize.off_policy import GATE_MEASURES, gate_measures
from tasks.finalize.ragged import offsets, owners_of, run_sums
from tasks.ids import shard_name
from tasks.models.provenance import WEIGHTS_VERIFIED
from tasks.records.dataset_row import DatasetRow, upgrade_rows
from tasks.storage.dataset_manifest import DatasetMarker
from tasks.storage.marker import MarkedFile, read_marked_bytes
from tasks.storage.objects import ObjectStore

PARALLEL_PARTS = 2  # parts read at once: decoding one batch at a time leaves a core idle
BATCH_ROWS = 512  # dataset rows decoded and profiled at once (~1 M tokens at 2 k tokens a row)

_SCALARS = ("rollout_id", "group_id", "sample_mask", "mask_reason", "advantage", "reward", "group_size")
_TOKEN_COUNTS = ("sampled_tokens", "nonfinite_logprobs", "positive_sampled_logprobs", "nonzero_carried_logprobs")


def profile_dataset(batch: Batch, manifest: DatasetMarker) -> dict[str, pa.Table]:
    """The four profile tables of the dataset ``manifest`` names; rows keep the manifest's part order."""
    store, config = batch.store, batch.config
    metrics = batch.dataset_metrics(manifest)
    verified = verified_weights(metrics)
    empty = row_profile(DatasetRow.arrow_schema().empty_table(), verified)  # the profile's schema, whatever the parts
    with ThreadPoolExecutor(PARALLEL_PARTS, thread_name_prefix="dataset-profile") as pool:
        parts = list(
            pool.map(lambda part: [row_profile(b, verified) for b in part_batches(store, part)], manifest.parts)
        )
    rows = pa.concat_tables([empty, *(batch for part in parts for batch in part)])
    present = [shard for shard in range(config.shards) if shard not in manifest.missing_shards]
    planned = pa.array([p.rollout_id for s in present for p in batch.shard_plan(s)], pa.string())
    trainable_ids = pc.filter(rows["rollout_id"], pc.equal(rows["sample_mask"], 1))
    return {
        "shards": pa.table(
            {
                "shard": [shard_name(s) for s in range(config.shards)],
                "in_dataset": [s not in manifest.missing_shards for s in range(config.shards)],
            }
        ),
        "rows": rows,
        "groups": group_profile(rows),
        "rollouts": pa.table({"rollout_id": planned, "trainable": pc.is_in(planned, value_set=trainable_ids)}),
        "off_policy": off_policy_profile(config.batch_id, (metrics.get("audit") or {}).get("off_policy")),
    }


def off_policy_profile(batch_id: str, off_policy: Mapping[str, Any] | None) -> pa.Table:
    """The ``off_policy`` table: one row of the gate's measures (null when not measured)."""
    measures = gate_measures(off_policy)
    columns: dict[str, pa.Array] = {"batch_id": pa.array([batch_id], pa.string())}
    for name in GATE_MEASURES:
        counts = ("nan_tokens", "missing_mask_tokens", "staleness_max", "unexplained_rows")
        kind = pa.int64() if name in counts else pa.float64()
        columns[name] = pa.array([measures[name]], kind)
    return pa.table(columns)


def part_batches(store: ObjectStore, part: MarkedFile) -> Iterator[pa.Table]:
    """The rows of a part the marker names, :data:`BATCH_ROWS` at a time; its size, sha256 and schema checked first.

    The checks are :func:`tasks.storage.dataset_manifest.read_dataset_part`'s: the file's schema is checked
    before any row is decoded, and each batch's nulls as it is; a part of an older schema version is read
    as the current one (:func:`~tasks.records.dataset_row.upgrade_rows`).
    """
    file = pq.ParquetFile(pa.BufferReader(read_marked_bytes(store, part, marker="the dataset marker")))
    source = f"{store.url}/{part.path}"
    DatasetRow.check_table(upgrade_rows(file.schema_arrow.empty_table()), source=source)
    for batch in file.iter_batches(batch_size=BATCH_ROWS):
        table = upgrade_rows(pa.Table.from_batches([batch]))
        DatasetRow.check_table(table, source=source)
        yield table


def verified_weights(metrics: Mapping[str, Any]) -> dict[int, str]:
    """Version -> sha256 of every weight version the batch verified (``weights_by_version`` of its metrics)."""
    by_version = metrics.get("weights_by_version") or {}
    return {
        int(version): entry["weights_sha256"]
        for version, entry in by_version.items()
        if entry.get("weights") == WEIGHTS_VERIFIED and entry.get("weights_sha256")
    }


def row_profile(part: pa.Table, verified: Mapping[int, str]) -> pa.Table:
    """One row of counts and scalars per dataset row of ``part`` (module docstring); ``verified`` is
    :func:`verified_weights`."""
    lengths = {name: pc.list_value_length(part[name]) for name in ("input_ids", "loss_mask", "logprobs")}
    paired = pc.equal(lengths["loss_mask"], lengths["logprobs"]).to_numpy(zero_copy_only=False)
    counts = _token_counts(part.filter(pa.array(paired)) if not paired.all() else part)
    columns = {name: part[name] for name in _SCALARS[:2]}
    columns |= {f"{name}_len": lengths[name] for name in lengths}
    for name, values in counts.items():
        full = np.zeros(part.num_rows, np.int64)
        full[paired] = values
        columns[name] = pa.array(full, mask=~paired)
    columns |= {name: part[name] for name in _SCALARS[2:]}
    columns["advantage_finite"] = pc.fill_null(pc.is_finite(part["advantage"]), False)
    columns["weights_within_batch"] = _weights_within_batch(part, verified)
    return pa.table(columns)


def _weights_within_batch(part: pa.Table, verified: Mapping[int, str]) -> pa.Array:
    """Per row: every (version, sha256) its ``weights_by_version`` names is one the batch verified (null sha256s
    claim nothing)."""
    weights = part["weights_by_version"].combine_chunks()
    lengths = pc.list_value_length(weights).to_numpy(zero_copy_only=False)
    items = pc.list_flatten(weights)
    sha256 = pc.struct_field(items, "weights_sha256")
    named = pc.binary_join_element_wise(pc.cast(pc.struct_field(items, "weight_version"), pa.string()), sha256, ":")
    allowed = pa.array([f"{version}:{sha}" for version, sha in verified.items()], pa.string())
    within = pc.or_kleene(pc.is_null(sha256), pc.is_in(named, value_set=allowed))  # a null sha256 claims nothing
    unverified = np.flatnonzero(~within.to_numpy(zero_copy_only=False))
    return pa.array(np.bincount(owners_of(offsets(lengths), unverified), minlength=part.num_rows) == 0)


def _token_counts(part: pa.Table) -> dict[str, np.ndarray]:
    """The counts of :data:`_TOKEN_COUNTS` per row of ``part``, whose loss_mask and logprobs pair up token by token.

    Record batch by record batch (no copy of the token lists). Loss-mask sums are run sums; the
    three other counts are of tokens that break a rule, so only those tokens are located (none in
    a clean dataset).
    """
    counts: dict[str, list[np.ndarray]] = {name: [] for name in _TOKEN_COUNTS}
    for batch in part.select(["loss_mask", "logprobs"]).to_batches():
        mask, logprobs = batch.column(0), batch.column(1)
        starts = offsets(pc.list_value_length(mask).to_numpy(zero_copy_only=False))
        sampled = mask.flatten().to_numpy()
        values = logprobs.flatten().to_numpy()
        carried = sampled == 0
        counts["sampled_tokens"].append(run_sums(sampled, starts))
        broken = {
            "nonfinite_logprobs": ~np.isfinite(values),
            "positive_sampled_logprobs": ~carried & (values > 0),
            "nonzero_carried_logprobs": carried & (values != 0),
        }
        for name, flags in broken.items():
            rows = owners_of(starts, np.flatnonzero(flags))
            counts[name].append(np.bincount(rows, minlength=batch.num_rows).astype(np.int64))
    return {name: np.concatenate(found) if found else np.zeros(0, np.int64) for name, found in counts.items()}


def group_profile(rows: pa.Table) -> pa.Table:
    """One row per group of the row profile: its rollouts, group_size, and the mean advantage of its trainable rollouts.

    Rows are collapsed to rollouts first (a rollout of independent calls has a row per call, all
    with its reward and advantage), so every rollout counts once.
    """
    per_rollout = rows.group_by(["group_id", "rollout_id"], use_threads=False).aggregate(
        [("sample_mask", "max"), ("advantage", "mean"), ("reward", "min"), ("group_size", "max")]
    )
    sizes = per_rollout.group_by("group_id", use_threads=False).aggregate(
        [("rollout_id", "count"), ("group_size_max", "max")]
    )
    trainable = per_rollout.filter(pc.equal(per_rollout["sample_mask_max"], 1)).group_by("group_id", use_threads=False)
    signal = trainable.aggregate(
        [("advantage_mean", "mean"), ("advantage_mean", "count"), ("reward_min", "min"), ("reward_min", "max")]
    )
    found = pc.index_in(sizes["group_id"], value_set=signal["group_id"])
    checked = pc.and_(
        pc.greater_equal(signal["advantage_mean_count"], 2),
        pc.not_equal(signal["reward_min_min"], signal["reward_min_max"]),
    )
    mean = pc.take(pc.if_else(checked, signal["advantage_mean_mean"], pa.scalar(None, pa.float64())), found)
    return pa.table(
        {
            "group_id": sizes["group_id"],
            "rollouts": sizes["rollout_id_count"],
            "group_size": sizes["group_size_max_max"],
            "advantage_mean": mean,
        }
    )
