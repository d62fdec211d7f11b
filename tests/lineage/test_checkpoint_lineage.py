"""``rollout-ledger lineage CHECKPOINT`` walks the training loop back to checkpoint 0, every hop checked by hash.

The loop is built from its real records with tiny fake weights: checkpoint 0 → batch b0 (planned with checkpoint
0's folder and weights, its rows naming them) → its published dataset → checkpoint 1 (consumed it) → batch b1
(sampled by checkpoint 1) → checkpoint 2. Every hop verifies on the untouched chain; a tampered dataset marker,
a tampered checkpoint weights file, a tampered dataset part and a batch sampled by a checkpoint nobody has each
show as a failed hop, named, with the rest of the tree still walked, and the command exits 3. The training
step's OpenLineage events validate against the OpenLineage JSON Schemas.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from openlineage.client.serde import Serde

from tasks import layout
from tasks.batch import Batch
from tasks.config import BatchConfig, ModelSpec
from tasks.errors import EXIT_CONFLICT, EXIT_OK
from tasks.finalize.dataset_writer import stage_dataset
from tasks.finalize.weights import PlannedWeights
from tasks.lineage.checkpoints import Hop, render_tree, walk_checkpoint
from tasks.lineage.naming import batch_object, name_of_url
from tasks.lineage.training import TRAINING_JOB, training_lineage_events
from tasks.models.provenance import WEIGHTS_DECLARED, WEIGHTS_VERIFIED
from tasks.storage.objects import ObjectStore
from tasks.trainer.checkpoint import Checkpoint, ConsumedDataset, ParentCheckpoint, write_checkpoint
from tests.finalize.rollouts import BATCH_ID, assemble, commit_by_hand, make_rollout

from .openlineage_schemas import validate_event


def fake_weights(seed: bytes):
    """A build that writes a tiny Hugging Face-like folder whose weights are ``seed``'s bytes."""

    def build(folder: Path) -> None:
        (folder / "config.json").write_text('{"model_type": "fake"}')
        (folder / "model.safetensors").write_bytes(hashlib.sha256(seed).digest() * 8)

    return build


def publish_batch(
    runs: Path, sampler: Checkpoint | None, *, weights_sha256: str, reference: str, weights: str = WEIGHTS_VERIFIED
) -> str:
    """A published batch planned with ``reference`` at ``weights_sha256`` (``weights``: verified by the plan, or
    declared), its rows naming those weights at the sampler's weight version (none where the sha256 is empty): two
    groups of four two-call rollouts. Returns its URL."""
    version = sampler.weight_version if sampler is not None else 0
    config = BatchConfig(
        batch_id=BATCH_ID,
        environment="guess_number",
        num_tasks=2,
        group_size=4,
        shards=1,
        model=ModelSpec(reference=reference, weights_sha256=weights_sha256, weights=weights),
        weight_version=version,
    )
    url = str(runs / layout.batch_dir(BATCH_ID))
    store = ObjectStore(url)
    store.write_once(layout.plan_config(), config.to_json().encode())
    groups = [
        assemble(
            [make_rollout(task, s, reward=float(s % 2), versions=[version, version]) for s in range(4)],
            task=task,
            weights=PlannedWeights(version, weights_sha256 or None),
        )
        for task in range(2)
    ]
    commit_by_hand(store, stage_dataset(store, groups, config=config).marker)
    return url


def consumed(url: str) -> ConsumedDataset:
    marker = ObjectStore(url).read_bytes(layout.DATASET_MARKER)
    return ConsumedDataset(batch_url=url, batch_id=BATCH_ID, dataset_sha256=hashlib.sha256(marker).hexdigest())


def step(root: Path, parent: Checkpoint, seed: bytes, datasets: list[str]) -> Checkpoint:
    return write_checkpoint(
        root,
        step=parent.step + 1,
        weight_version=parent.weight_version + 1,
        parent=ParentCheckpoint(folder=str(parent.folder), weights_sha256=parent.weights_sha256),
        consumed=[consumed(url) for url in datasets],
        build=fake_weights(seed),
    )


@dataclass(frozen=True)
class Loop:
    root: Path
    checkpoints: list[Checkpoint]
    batches: list[str]


@pytest.fixture
def loop(tmp_path) -> Loop:
    """checkpoint 0 → b0 → checkpoint 1 → b1 → checkpoint 2."""
    root = tmp_path / "checkpoints"
    zero = write_checkpoint(root, step=0, weight_version=0, parent=None, consumed=(), build=fake_weights(b"zero"))
    b0 = publish_batch(tmp_path / "runs0", zero, weights_sha256=zero.weights_sha256, reference=str(zero.folder))
    one = step(root, zero, b"one", [b0])
    b1 = publish_batch(tmp_path / "runs1", one, weights_sha256=one.weights_sha256, reference=str(one.folder))
    two = step(root, one, b"two", [b1])
    return Loop(root, [zero, one, two], [b0, b1])


def hops(tree: Hop) -> list[Hop]:
    return [tree, *(hop for child in tree.children for hop in hops(child))]


def failed_checks(tree: Hop) -> list[tuple[str, str, str]]:
    return [(hop.kind, hop.name, check.name) for hop in tree.failed() for check in hop.checks if not check.ok]


def rewrite(path: Path, data: bytes) -> None:
    os.chmod(path, 0o644)
    path.write_bytes(data)


def test_an_untouched_loop_walks_back_to_checkpoint_zero_with_every_hop_verified(loop):
    tree = walk_checkpoint(loop.checkpoints[2].folder)
    assert tree.all_ok, render_tree(tree)
    walked = [(h.kind, h.relation, h.facts.get("step")) for h in hops(tree) if not h.seen]
    assert walked == [
        ("checkpoint", "start", 2),
        ("dataset", "consumed", None),
        ("batch", "batch", None),
        ("checkpoint", "sampled by", 1),
        ("dataset", "consumed", None),
        ("batch", "batch", None),
        ("checkpoint", "sampled by", 0),
    ]
    sampled = [h for h in hops(tree) if h.relation == "sampled by"]
    assert [Path(h.name) for h in sampled] == [loop.checkpoints[1].folder, loop.checkpoints[0].folder]
    parents = [h for h in hops(tree) if h.relation == "parent"]
    assert parents and all(h.seen and h.ok for h in parents)  # the same checkpoints, links checked again
    zero = next(h for h in hops(tree) if h.facts.get("step") == 0 and not h.seen)
    assert [c.name for c in zero.checks] == ["manifest", "link", "weights", "root"]
    datasets = [h for h in hops(tree) if h.kind == "dataset"]
    assert {c.name for h in datasets for c in h.checks} == {"marker", "batch", "parts"}
    assert [h.name for h in datasets] == [f"{url}/dataset" for url in reversed(loop.batches)]


def test_a_tampered_dataset_marker_is_a_failed_hop_and_the_rest_still_walks(loop):
    marker = Path(loop.batches[0]) / layout.DATASET_MARKER
    raw = json.loads(marker.read_bytes())
    raw["committed_at"] += 1.0
    rewrite(marker, json.dumps(raw, sort_keys=True, indent=2).encode() + b"\n")
    tree = walk_checkpoint(loop.checkpoints[2].folder)
    assert failed_checks(tree) == [("dataset", f"{loop.batches[0]}/dataset", "marker")]
    assert "_COMMITTED.json sha256" in render_tree(tree)
    assert any(h.relation == "parent" and h.facts.get("step") == 0 and h.ok for h in hops(tree))  # via the parent


def test_a_tampered_checkpoint_weights_file_fails_that_checkpoint_wherever_it_is_reached(loop):
    weights = loop.checkpoints[0].folder / "model.safetensors"
    rewrite(weights, weights.read_bytes()[::-1])
    tree = walk_checkpoint(loop.checkpoints[2].folder)
    assert failed_checks(tree) == [("checkpoint", str(loop.checkpoints[0].folder), "weights")]
    text = render_tree(tree)
    assert "[FAILED] sampled by: checkpoint" in text and "! weights: weight files hash to" in text
    assert text.endswith("1 hop(s) did not verify\n")


def test_a_tampered_dataset_part_fails_the_dataset_and_leaves_its_rows_unread(loop):
    part = Path(loop.batches[1]) / layout.dataset_part(0)
    data = bytearray(part.read_bytes())
    data[-20] ^= 0xFF
    rewrite(part, bytes(data))
    tree = walk_checkpoint(loop.checkpoints[2].folder)
    assert failed_checks(tree) == [
        ("dataset", f"{loop.batches[1]}/dataset", "parts"),
        ("batch", BATCH_ID, "rows"),
    ]


def test_a_batch_sampled_by_an_unknown_checkpoint_is_a_failed_hop_naming_its_weights(loop, tmp_path):
    elsewhere = write_checkpoint(
        tmp_path / "elsewhere", step=0, weight_version=0, parent=None, consumed=(), build=fake_weights(b"stranger")
    )
    stray = publish_batch(
        tmp_path / "runs2", elsewhere, weights_sha256=elsewhere.weights_sha256, reference="/no/such/model"
    )
    three = step(loop.root, loop.checkpoints[2], b"three", [stray])
    tree = walk_checkpoint(three.folder)
    assert failed_checks(tree) == [("checkpoint", "unknown", "found")]
    assert f"weights {elsewhere.weights_sha256[:12]}" in render_tree(tree)
    found = walk_checkpoint(three.folder, checkpoint_roots=[tmp_path / "elsewhere"])  # searched there: it verifies
    assert found.all_ok, render_tree(found)


def test_rows_whose_weights_were_declared_not_verified_fail_the_batch_hop(loop, tmp_path):
    zero = loop.checkpoints[0]
    declared = publish_batch(tmp_path / "runs3", None, weights_sha256="", reference=str(zero.folder))
    lone = step(tmp_path / "other-root", zero, b"lone", [declared])
    tree = walk_checkpoint(lone.folder)
    assert ("batch", BATCH_ID, "model") in failed_checks(tree)
    assert ("batch", BATCH_ID, "rows") in failed_checks(tree)


def test_a_server_batch_whose_rows_all_name_the_served_weights_verifies(loop, tmp_path):
    zero = loop.checkpoints[0]
    served = publish_batch(
        tmp_path / "runs4", zero, weights_sha256=zero.weights_sha256, reference=str(zero.folder),
        weights=WEIGHTS_DECLARED,
    )  # fmt: skip
    lone = step(tmp_path / "other-root", zero, b"served", [served])
    tree = walk_checkpoint(lone.folder)
    assert tree.all_ok, render_tree(tree)
    (batch,) = [h for h in hops(tree) if h.kind == "batch"]
    assert "(named by every row)" in next(c.detail for c in batch.checks if c.name == "model")


def test_the_command_prints_the_tree_or_json_and_exits_3_when_a_hop_fails(loop, capsys):
    from tasks.cli.main import main

    assert main(["lineage", str(loop.checkpoints[2].folder)]) == EXIT_OK
    text = capsys.readouterr().out
    assert text.startswith(f"[ok] checkpoint {loop.checkpoints[2].folder}  step 2")
    assert text.endswith("every hop verified\n")
    weights = loop.checkpoints[1].folder / "model.safetensors"
    rewrite(weights, b"changed")
    assert main(["lineage", "--json", str(loop.checkpoints[2].folder)]) == EXIT_CONFLICT
    shown = json.loads(capsys.readouterr().out)
    assert shown["ok"] is False and shown["failed"] == [f"checkpoint {loop.checkpoints[1].folder}"]
    assert shown["tree"]["children"][0]["kind"] == "dataset"


def test_the_training_step_events_name_the_datasets_and_parent_as_inputs_and_the_checkpoint_as_output(loop):
    two = loop.checkpoints[2]
    start, complete = training_lineage_events(two, namespace="loop")
    for event in (start, complete):
        serialized = Serde.to_dict(event)
        assert validate_event(serialized) == []
        assert serialized["job"] == {**serialized["job"], "namespace": "loop", "name": TRAINING_JOB}
        assert serialized["run"]["runId"] == Serde.to_dict(start)["run"]["runId"]
        inputs = {(d["namespace"], d["name"]): d["facets"]["version"]["datasetVersion"] for d in serialized["inputs"]}
        dataset = name_of_url(f"{loop.batches[1]}/dataset")
        runs = Path(loop.batches[1]).parents[1]  # ROOT/batches/BATCH_ID: publish's name for the same dataset
        assert dataset == batch_object(Batch.open(str(runs), BATCH_ID), layout.DATASET_DIR)
        assert inputs == {
            (dataset.namespace, dataset.name): two.manifest.consumed[0].dataset_sha256,
            tuple(name_of_url(str(loop.checkpoints[1].folder))): loop.checkpoints[1].weights_sha256,
        }
    assert [e.eventType.value for e in (start, complete)] == ["START", "COMPLETE"]
    assert start.outputs == []
    (output,) = Serde.to_dict(complete)["outputs"]
    assert (output["namespace"], output["name"]) == tuple(name_of_url(str(two.folder)))
    assert output["facets"]["version"]["datasetVersion"] == two.weights_sha256
    assert dataclasses.asdict(two.manifest.parent)["weights_sha256"] == loop.checkpoints[1].weights_sha256
