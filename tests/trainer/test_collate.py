"""The torch Dataset over published parts and the right-padding GRPO collator (also with HF datasets)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tasks.errors import SegmentChecksumMismatchError
from tasks.finalize.dataset_writer import stage_dataset
from tasks.storage.objects import ObjectStore
from tasks.trainer.collate import GrpoCollator, PublishedDataset
from tests.finalize.rollouts import batch_config, commit_by_hand, mixed_groups, rows_of

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


def test_dataset_from_copied_part_files_matches_the_published_one(published, tmp_path):
    _, rows = published
    parts = sorted(str(p) for p in (tmp_path / "batch" / "dataset").glob("part-*.parquet"))
    copied = PublishedDataset.from_files(parts)
    assert [copied[i]["rollout_id"] for i in range(len(copied))] == [r.rollout_id for r in rows]
