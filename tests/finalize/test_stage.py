"""The finalize stage's preconditions and storage: partial batches say so everywhere, credentials reach every read.

Batches come from the fake scripted engine (real tokenizer, real storage): a three-shard batch
with shards 0 and 2 committed and shard 1 never generated, and the single-shard ``fake_batch``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.config import ModelSpec
from tasks.errors import ConfigError, NoCommittedShardsError, UncommittedShardsError
from tasks.finalize.card import render_card
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shard
from tasks.plan import plan_batch
from tasks.storage.objects import ObjectStore
from tasks.trainer.collate import PublishedDataset

from .conftest import CommittedBatch, fresh_copy, guess_number_config
from .rollouts import commit_by_hand

NO_AUDIT = FinalizeOptions(audit=False)
PARTIAL = FinalizeOptions(audit=False, allow_partial=True)


@pytest.fixture(scope="module")
def gapped_batch(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> CommittedBatch:
    """Three planned shards; 0 and 2 committed, 1 never generated."""
    from tests.generation.fakes import FakeScriptedEngine

    root = tmp_path_factory.mktemp("gapped-batch")
    config = guess_number_config("b-gapped", ModelSpec(reference="fake-model"), num_tasks=3, shards=3)
    plan_batch(Batch.open(str(root), config.batch_id), config)
    engine = FakeScriptedEngine(tokenizer, reply=lambda request: str(request.seed % 8 + 1))
    for shard in (0, 2):
        generate_shard(Batch.open(str(root), config.batch_id), shard, engine=engine, run=asyncio.run, progress=False)
    return CommittedBatch(root=root, config=config)


def dataset_files(batch: CommittedBatch) -> tuple[dict, dict, str]:
    """The batch's staged marker and metrics.json as stored, and the card publish would write from them."""
    marker = json.loads((batch.dir / layout.DATASET_STAGED).read_text())
    metrics = json.loads((batch.dir / layout.DATASET_METRICS).read_text())
    card = render_card(
        batch_id=marker["batch_id"],
        config=marker["config"],
        metrics=metrics,
        parts=marker["parts"],
        validation={},
        review=None,
    )
    assert not (batch.dir / layout.DATASET_CARD).exists(), "the card is publish's, not finalize's"
    return marker, metrics, card


def test_uncommitted_shards_are_refused_by_number_unless_partial_is_allowed(gapped_batch: CommittedBatch) -> None:
    with pytest.raises(UncommittedShardsError, match=r"shard\(s\) \[1\] of 3 have no commit marker.*--allow-partial"):
        finalize_batch(gapped_batch.handle, NO_AUDIT)
    assert not (gapped_batch.dir / layout.DATASET_DIR).exists()


def test_a_partial_dataset_names_its_missing_shards_in_marker_metrics_and_card(
    gapped_batch: CommittedBatch, tmp_path: Path
) -> None:
    batch = fresh_copy(gapped_batch, tmp_path)
    published = finalize_batch(batch.handle, PARTIAL)
    assert (published.marker.partial, published.marker.missing_shards) == (True, (1,))
    marker, metrics, card = dataset_files(batch)
    assert (marker["partial"], marker["missing_shards"]) == (True, [1])
    assert (metrics["partial"], metrics["missing_shards"]) == (True, [1])
    title, first_paragraph = card.split("---\n", 2)[2].strip().split("\n\n")[:2]
    assert title == f"# GRPO dataset `{batch.config.batch_id}`"
    assert first_paragraph.startswith("PARTIAL: shards [1] are missing")
    planned_in_committed_shards = 2 * batch.config.group_size  # one task per shard
    assert published.marker.rows == metrics["planned_rollouts"] == planned_in_committed_shards


def test_finalizing_a_partial_dataset_again_returns_it_still_marked_partial(
    gapped_batch: CommittedBatch, tmp_path: Path
) -> None:
    batch = fresh_copy(gapped_batch, tmp_path)
    first = finalize_batch(batch.handle, PARTIAL)
    again = finalize_batch(batch.handle, NO_AUDIT)
    assert not again.created and again.marker == first.marker and again.marker.partial


def test_a_batch_without_any_committed_shard_is_refused_even_when_partial_is_allowed(tmp_path: Path) -> None:
    config = guess_number_config("b-empty", ModelSpec(reference="fake-model"), shards=2)
    plan_batch(Batch.open(str(tmp_path), config.batch_id), config)
    with pytest.raises(NoCommittedShardsError, match=r"none of its 2 shard\(s\).*rollout-ledger generate"):
        finalize_batch(Batch.open(str(tmp_path), config.batch_id), PARTIAL)
    assert not Batch.open(str(tmp_path), config.batch_id).store.exists(layout.DATASET_STAGED)


def test_a_complete_dataset_records_that_it_is_not_partial(fake_batch: CommittedBatch, tmp_path: Path) -> None:
    batch = fresh_copy(fake_batch, tmp_path)
    published = finalize_batch(batch.handle, PARTIAL)
    assert (published.marker.partial, published.marker.missing_shards) == (False, ())
    marker, metrics, card = dataset_files(batch)
    assert (marker["partial"], marker["missing_shards"]) == (False, [])
    assert (metrics["partial"], metrics["missing_shards"]) == (False, [])
    assert "PARTIAL" not in card


def test_storage_options_reach_every_read_and_write_of_finalize_and_the_collator(
    fake_batch: CommittedBatch, tmp_path: Path
) -> None:
    # dir://root means nothing without its options (the folder it is rooted at), as s3:// without credentials.
    batch = fresh_copy(fake_batch, tmp_path)
    url, options = "dir://root", {"path": str(tmp_path), "target_protocol": "file"}
    with pytest.raises(ConfigError, match=r"plan/batch\.json does not exist"):  # options rooted elsewhere
        finalize_batch(Batch.open(url, batch.config.batch_id, {**options, "path": str(tmp_path / "no")}), NO_AUDIT)
    staged = finalize_batch(Batch.open(url, batch.config.batch_id, options), NO_AUDIT)
    assert staged.created and (batch.dir / layout.DATASET_STAGED).exists()
    commit_by_hand(ObjectStore(url, **options).child(layout.batch_dir(batch.config.batch_id)), staged.marker)
    data = PublishedDataset.from_url(staged.url, storage_options=options)
    assert len(data) == staged.marker.rows == batch.config.num_rollouts


def test_the_stage_imports_no_torch_until_the_audit_runs() -> None:
    probe = "import sys, tasks.finalize.stage; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"
