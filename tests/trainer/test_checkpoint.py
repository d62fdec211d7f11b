"""Checkpoints: the manifest round trip, its refusals (tampered weights, another format), atomic writes, the chain."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tasks.models.provenance import hashed_weights
from tasks.trainer.checkpoint import (
    CHECKPOINT_FORMAT,
    MANIFEST_KEYS,
    MANIFEST_NAME,
    CheckpointConflictError,
    CheckpointManifest,
    CheckpointWeightsMismatchError,
    ConsumedDataset,
    MalformedCheckpointError,
    NoCheckpointError,
    ParentCheckpoint,
    checkpoint_chain,
    checkpoint_folders,
    checkpoint_zero,
    read_checkpoint,
    write_checkpoint,
)
from tests.trainer.step_batches import tiny_model_folder

SHA = "ab" * 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def root(tiny, tmp_path):
    checkpoint_zero(tiny, tmp_path / "ckpts")
    return tmp_path / "ckpts"


def copy_build(source):
    def build(tmp):
        for file in source.iterdir():
            if file.is_file() and file.name != MANIFEST_NAME:
                shutil.copyfile(file, tmp / file.name)

    return build


def test_checkpoint_zero_is_the_model_byte_for_byte_with_its_manifest(tiny, root):
    checkpoint = read_checkpoint(root / "step-000000")
    assert checkpoint.weights_sha256 == hashed_weights(tiny) == hashed_weights(checkpoint.folder)
    raw = json.loads((checkpoint.folder / MANIFEST_NAME).read_text())
    assert list(raw) == list(MANIFEST_KEYS)
    assert raw["format"] == CHECKPOINT_FORMAT and raw["version"] == 1
    assert (raw["step"], raw["weight_version"], raw["parent"], raw["consumed"]) == (0, 0, None, [])
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (checkpoint.folder / name).read_bytes() == (tiny / name).read_bytes()
    assert checkpoint_zero(tiny, root).manifest == checkpoint.manifest  # again: a no-op


def test_manifest_round_trips_with_parent_and_consumed_datasets():
    manifest = CheckpointManifest(
        step=3,
        weight_version=7,
        weights_sha256=SHA,
        parent=ParentCheckpoint(folder="/ckpts/step-000002", weights_sha256="cd" * 32),
        consumed=(ConsumedDataset(batch_url="s3://b/runs/batches/x", batch_id="x", dataset_sha256="ef" * 32),),
        created_at="2026-12-06T07:00:00.000+00:00",
    )
    assert CheckpointManifest.from_json(manifest.to_json(), source="test") == manifest
    raw = json.loads(manifest.to_json())
    assert raw["parent"] == {"folder": "/ckpts/step-000002", "weights_sha256": "cd" * 32}
    assert raw["consumed"] == [{"batch_url": "s3://b/runs/batches/x", "batch_id": "x", "dataset_sha256": "ef" * 32}]


def test_tampered_weights_are_refused_by_name(root):
    weights = root / "step-000000" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointWeightsMismatchError) as raised:
        read_checkpoint(root / "step-000000")
    assert raised.value.reason == "checkpoint_weights_mismatch" and raised.value.exit_code == 3
    with pytest.raises(CheckpointWeightsMismatchError):
        checkpoint_chain(root)  # the latest is always hashed before it is used


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"format": "hf-checkpoint"}, "format"),
        ({"version": 2}, "version"),
        ({"weights_sha256": "xyz"}, "sha256"),
        ({"step": 1}, "step"),  # step 1 without a parent, in the folder of step 0
        ({"extra": 1}, "fields"),
        ({"consumed": [{"batch_url": "u"}]}, "consumed"),
        ({"created_at": "yesterday"}, "created_at"),
    ],
)
def test_a_manifest_of_another_format_is_refused(root, change, named):
    path = root / "step-000000" / MANIFEST_NAME
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(MalformedCheckpointError, match=named) as raised:
        read_checkpoint(root / "step-000000")
    assert raised.value.reason == "malformed_checkpoint"


def test_a_folder_without_manifest_is_no_checkpoint(tiny, tmp_path):
    with pytest.raises(MalformedCheckpointError, match=r"no checkpoint\.json"):
        read_checkpoint(tiny)
    with pytest.raises(NoCheckpointError):
        checkpoint_chain(tmp_path / "empty")


def test_a_killed_writer_leaves_no_checkpoint_and_its_folder_is_swept(root, tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    torn = root / f".step-000001.tmp-{int(dead.stdout)}-0a0b"
    shutil.copytree(root / "step-000000", torn)  # a half-written step 1, manifest and all
    assert [p.name for p in checkpoint_folders(root)] == ["step-000000"]
    assert [c.step for c in checkpoint_chain(root)] == [0]

    def failing(tmp):
        copy_build(root / "step-000000")(tmp)
        raise RuntimeError("killed while writing")

    parent = ParentCheckpoint(str(root / "step-000000"), read_checkpoint(root / "step-000000").weights_sha256)
    with pytest.raises(RuntimeError):
        write_checkpoint(root, step=1, weight_version=1, parent=parent, consumed=(), build=failing)
    assert not torn.exists(), "the dead writer's folder is swept"
    assert sorted(p.name for p in root.iterdir()) == ["step-000000"]


def test_steps_form_a_chain_and_a_step_is_written_once(root):
    zero = read_checkpoint(root / "step-000000")
    parent = ParentCheckpoint(str(zero.folder), zero.weights_sha256)
    consumed = (ConsumedDataset("file:///runs/batches/a", "a", SHA),)
    one = write_checkpoint(
        root, step=1, weight_version=1, parent=parent, consumed=consumed, build=copy_build(zero.folder)
    )
    assert [c.step for c in checkpoint_chain(root)] == [0, 1] and one.manifest.consumed == consumed
    with pytest.raises(CheckpointConflictError):
        write_checkpoint(root, step=1, weight_version=1, parent=parent, consumed=(), build=copy_build(zero.folder))
    shutil.move(root / "step-000001", root / "step-000002")
    with pytest.raises(MalformedCheckpointError):
        checkpoint_chain(root)


def test_checkpoint_zero_of_other_weights_conflicts(root, tmp_path):
    other = tiny_model_folder(tmp_path / "other", seed=1)
    with pytest.raises(CheckpointConflictError):
        checkpoint_zero(other, root)
