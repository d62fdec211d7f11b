"""The torch Dataset over published parts and the right-padding GRPO collator (also with HF datasets)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tasks.errors import SegmentChecksumMismatchError
from tasks.finalize.dataset_writer import stage_dataset
from tasks.records.dataset_row import SAMPLING_COLUMNS
from tasks.storage.objects import ObjectStore
from tasks.trainer.collate import GrpoCollator, PublishedDataset
from tests.finalize.rollouts import (
    TRUNCATED,
    assemble,
    batch_config,
    commit_by_hand,
    make_rollout,
    mixed_groups,
    rows_of,
)

PAD = 7


@pytest.fixture
def published(tmp_path):
    """A tiny published batch (3 groups × 4, one poisoned and one missing rollout) and its rows.

    Committed by hand the way publish commits a staged dataset (the validation suites are not
    what this file tests).
    """
    config = batch_config()
    groups = mixed_groups(config)
    url = str(tmp_path / "batch")
    store = ObjectStore(url)
    commit_by_hand(store, stage_dataset(store, groups, config=config, rows_per_part=5).marker)
    return url, [row for g in groups for row in rows_of(g)]


def test_dataset_reads_every_committed_row_in_order(published):
    url, rows = published
    data = PublishedDataset.from_url(url)
    assert len(data) == len(rows)
    for item, row in zip(data, rows, strict=True):
        assert item["rollout_id"] == row.rollout_id
        np.testing.assert_array_equal(item["input_ids"].numpy(), row.input_ids)
        np.testing.assert_array_equal(item["logprobs"].numpy(), row.logprobs)
        assert float(item["advantage"]) == row.advantage


def test_collator_right_pads_and_broadcasts_advantages_over_sampled_tokens(published):
    url, rows = published
    batch = GrpoCollator(pad_token_id=PAD)([PublishedDataset.from_url(url)[i] for i in range(4)])
    lengths = [row.input_ids.size for row in rows[:4]]
    assert batch["input_ids"].shape == (4, max(lengths))
    for i, (row, length) in enumerate(zip(rows[:4], lengths, strict=True)):
        assert batch["attention_mask"][i].sum() == length
        assert (batch["input_ids"][i, length:] == PAD).all()
        np.testing.assert_array_equal(batch["input_ids"][i, :length].numpy(), row.input_ids)
        expected = row.advantage * row.loss_mask.astype(np.float32)
        np.testing.assert_allclose(batch["advantages"][i, :length].numpy(), expected, rtol=1e-6)
        assert (batch["loss_mask"][i, length:] == 0).all() and (batch["logprobs"][i, length:] == 0).all()


def test_masked_rows_never_reach_the_train_mask(published):
    url, rows = published
    data = PublishedDataset.from_url(url)
    batch = GrpoCollator()([data[i] for i in range(len(data))])
    masked = [i for i, row in enumerate(rows) if row.sample_mask == 0]
    assert masked and all(batch["train_mask"][i].sum() == 0 for i in masked)
    assert batch["sample_mask"].tolist() == [float(r.sample_mask) for r in rows]
    assert batch["train_mask"].sum() == sum(int(r.loss_mask.sum()) for r in rows if r.sample_mask == 1)


def test_dataloader_batches_with_the_collator(published):
    url, rows = published
    loader = DataLoader(PublishedDataset.from_url(url), batch_size=5, collate_fn=GrpoCollator(pad_to_multiple_of=8))
    batches = list(loader)
    assert [b["input_ids"].shape[0] for b in batches] == [5, 5, 2]
    assert all(b["input_ids"].shape[1] % 8 == 0 for b in batches)
    assert [rid for b in batches for rid in b["rollout_id"]] == [r.rollout_id for r in rows]


def test_dataset_refuses_a_tampered_part(published, tmp_path):
    url, _ = published
    part = tmp_path / "batch" / "dataset" / "part-00001.parquet"
    part.chmod(0o644)
    part.write_bytes(b"\x00" + part.read_bytes()[1:])
    with pytest.raises(SegmentChecksumMismatchError, match="part-00001"):
        PublishedDataset.from_url(url)


def test_unpublished_batch_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no committed dataset"):
        PublishedDataset.from_url(str(tmp_path / "nothing"))


def test_hugging_face_datasets_loads_the_parts_and_the_collator_accepts_its_rows(published, tmp_path):
    datasets = pytest.importorskip("datasets")
    url, rows = published
    loaded = datasets.load_dataset(
        "parquet", data_files=f"{url}/dataset/part-*.parquet", split="train", cache_dir=str(tmp_path / "hf-cache")
    )
    assert loaded.num_rows == len(rows)
    assert loaded[0]["rollout_id"] == rows[0].rollout_id
    assert loaded[0]["call_spans"][0]["carry_len"] == rows[0].call_spans[0].carry_len
    from_hf = GrpoCollator(pad_token_id=PAD)([loaded[i] for i in range(len(rows))])
    data = PublishedDataset.from_url(url)
    from_torch = GrpoCollator(pad_token_id=PAD)([data[i] for i in range(len(data))])
    for name in ("input_ids", "attention_mask", "loss_mask", "logprobs", "advantages", "train_mask"):
        assert torch.equal(from_hf[name], from_torch[name]), name
    for name in ("temperature", "top_p", "top_k", "sampling_recorded", "truncates", "kept_counts", "kept_token_ids"):
        assert torch.equal(from_hf[name], from_torch[name]), name


def test_dataset_from_copied_part_files_matches_the_published_one(published, tmp_path):
    _, rows = published
    parts = sorted(str(p) for p in (tmp_path / "batch" / "dataset").glob("part-*.parquet"))
    copied = PublishedDataset.from_files(parts)
    assert [copied[i]["rollout_id"] for i in range(len(copied))] == [r.rollout_id for r in rows]


@pytest.fixture
def truncated(tmp_path):
    """A published batch sampled with top-p 0.9 / top-k 50: two groups whose rows hold kept sets (one row masked
    keeping its tokens and sets, one masked without tokens), and its rows."""
    from tasks.finalize import reasons

    config = batch_config(num_tasks=2, group_size=3, sampling=TRUNCATED)
    groups = [
        assemble(
            [
                make_rollout(task, 0, kept=True, calls=((3 + task, 2), (2, 4))),
                make_rollout(task, 1, kept=True, reward=0.0, reason=reasons.NO_REWARD if task else None),
                make_rollout(task, 2, reason=reasons.CHAIN_HASH_MISMATCH, linearized=False),
            ],
            task=task,
            group_size=3,
            sampling=TRUNCATED,
        )
        for task in range(2)
    ]
    url = str(tmp_path / "truncated")
    store = ObjectStore(url)
    commit_by_hand(store, stage_dataset(store, groups, config=config, rows_per_part=4).marker)
    return url, [row for g in groups for row in rows_of(g)]


def test_items_say_how_each_row_was_sampled_and_hold_its_kept_sets(truncated):
    url, rows = truncated
    data = PublishedDataset.from_url(url)
    for item, row in zip(data, rows, strict=True):
        assert (float(item["temperature"]), float(item["top_p"]), int(item["top_k"])) == (0.9, 0.9, 50)
        assert bool(item["sampling_recorded"]) and item["logprobs_mode"] == "processed"
        np.testing.assert_array_equal(item["kept_counts"].numpy(), row.kept_counts)
        np.testing.assert_array_equal(item["kept_token_ids"].numpy(), row.kept_token_ids)
    assert sum(bool(row.kept) for row in rows) == 4  # every row with sampled tokens, masked or not


def test_the_collator_lays_the_kept_sets_out_flat_for_a_vectorized_renormalization(truncated):
    url, rows = truncated
    data = PublishedDataset.from_url(url)
    batch = GrpoCollator(pad_token_id=PAD, pad_to_multiple_of=8)([data[i] for i in range(len(data))])
    B, T = batch["input_ids"].shape
    assert batch["truncates"].all() and batch["sampling_recorded"].all() and batch["top_k"].tolist() == [50] * B
    counts, starts = batch["kept_counts"], batch["kept_starts"]
    ids, positions = batch["kept_token_ids"], batch["kept_positions"]
    for i, row in enumerate(rows):  # each row's sets, at its sampled positions, in order
        sampled = np.flatnonzero(row.loss_mask)
        np.testing.assert_array_equal(counts[i, sampled].numpy(), row.kept_counts)
        assert int(counts[i].sum()) == row.kept_token_ids.size
        for position, kept in zip(sampled.tolist(), row.kept.sets(), strict=True):
            lo = int(starts[i, position])
            np.testing.assert_array_equal(ids[lo : lo + kept.size].numpy(), kept)
            assert (positions[lo : lo + kept.size] == i * T + position).all()
    # renormalizing over the sets with one gather and one segment reduction equals doing it set by set
    logits = torch.randn(B * T, 50_010, generator=torch.Generator().manual_seed(0))
    kept_logits = logits[positions, ids]
    lse = torch.full((B * T,), float("-inf")).scatter_reduce(0, positions, kept_logits, "amax")
    lse = lse + torch.zeros(B * T).index_add(0, positions, (kept_logits - lse[positions]).exp()).log()
    for i, row in enumerate(rows):
        for position, kept in zip(np.flatnonzero(row.loss_mask).tolist(), row.kept.sets(), strict=True):
            expected = torch.logsumexp(logits[i * T + position, torch.as_tensor(kept, dtype=torch.int64)], 0)
            assert torch.allclose(lse[i * T + position], expected), (i, position)


def test_an_untruncated_batch_collates_with_no_kept_sets(published):
    url, _ = published
    data = PublishedDataset.from_url(url)
    batch = GrpoCollator()([data[i] for i in range(len(data))])
    assert batch["sampling_recorded"].all() and not batch["truncates"].any()
    assert batch["kept_counts"].sum() == 0 and batch["kept_token_ids"].numel() == batch["kept_positions"].numel() == 0


def test_rows_whose_sampling_is_not_recorded_collate_as_such(published):
    _, rows = published
    as_old = [
        {**{k: v for k, v in row.to_row().items() if k not in SAMPLING_COLUMNS}, "kept_counts": []} for row in rows
    ]
    batch = GrpoCollator()(as_old)  # rows of a `datasets` part of schema 2: no sampling keys at all
    assert not batch["sampling_recorded"].any() and not batch["truncates"].any()
    assert batch["temperature"].isnan().all() and batch["top_k"].eq(0).all() and batch["logprobs_mode"] == [None] * 12


def test_a_row_whose_kept_sets_do_not_match_its_sampled_tokens_is_refused(truncated):
    url, _ = truncated
    item = dict(PublishedDataset.from_url(url)[0])
    item["kept_counts"] = item["kept_counts"][:-1]
    with pytest.raises(ValueError, match=r"row r000000-00: 5 kept sets for 6 sampled tokens"):
        GrpoCollator()([item])
