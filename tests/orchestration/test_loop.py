"""The loop's events and refusals (tasks/orchestration/loop.py): what a checkpoint or dataset event may name.

An asset event is not trusted (anyone allowed to post one through the REST API can), so each
test here is a refusal the loop makes before anything is loaded, or the one path it accepts.
Checkpoints are real ones (``write_checkpoint``) with a small stand-in weights file.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.orchestration import loop
from tasks.orchestration.loop import CheckpointEvent, CheckpointEventError, LoopConfigError

SHA = "a" * 64


def extra(**changes):
    return {
        "weight_version": 1,
        "weights_sha256": SHA,
        "step": 1,
        "folder": "/ckpt/step-000001",
        "parent": None,
    } | changes


def write_step(root: Path, step: int, weights: bytes, parent=None):
    from tasks.trainer.checkpoint import write_checkpoint

    def build(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(weights)
        (tmp / "config.json").write_text("{}")

    return write_checkpoint(root, step=step, weight_version=step, parent=parent, consumed=(), build=build)


def chain(root: Path, steps: int):
    from tasks.trainer.checkpoint import ParentCheckpoint

    made = [write_step(root, 0, b"weights-0")]
    for step in range(1, steps):
        before = made[-1]
        parent = ParentCheckpoint(folder=str(before.folder), weights_sha256=before.weights_sha256)
        made.append(write_step(root, step, f"weights-{step}".encode(), parent))
    return made


def triggering(name: str, *extras):
    """Airflow's ``triggering_asset_events``: asset -> events, each with an ``extra``."""
    from airflow.sdk import Asset

    return {Asset(name): [SimpleNamespace(extra=e) for e in extras]}


@pytest.fixture
def root(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints"
    path.mkdir()
    monkeypatch.setenv(loop.CHECKPOINTS_ROOT_VARIABLE, str(path))
    return path


def test_a_checkpoint_event_round_trips_and_the_rest_api_mark_is_ignored():
    parent = {"folder": "/ckpt/step-000000", "weights_sha256": "b" * 64}
    event = CheckpointEvent.from_extra(extra(parent=parent) | {loop.FROM_REST_API: True})
    assert event.to_extra() == extra(parent=parent)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"step": -1}, "step must be an integer >= 0"),
        ({"step": True}, "step must be an integer >= 0"),
        ({"weight_version": "2"}, "weight_version must be an integer >= 0"),
        ({"weights_sha256": "A" * 64}, "weights_sha256 must be 64 lowercase hex digits"),
        ({"weights_sha256": SHA + "\n"}, "weights_sha256 must be 64 lowercase hex digits"),
        ({"folder": ""}, "folder must be a path"),
        ({"parent": {"folder": "/x"}}, "parent must be null or an object with ['folder', 'weights_sha256']"),
        ({"parent": {"folder": "/x", "weights_sha256": "nope"}}, "parent.weights_sha256 must be 64 lowercase hex"),
        ({"engine_kwargs": {"trust_remote_code": True}}, "unknown extra field(s) ['engine_kwargs']"),
    ],
)
def test_a_malformed_checkpoint_event_is_refused_naming_the_field(changes, named):
    with pytest.raises(CheckpointEventError, match=None) as refused:
        CheckpointEvent.from_extra(extra(**changes))
    assert named in str(refused.value)
    assert refused.value.reason == "refused_checkpoint_event"


def test_an_event_missing_fields_is_refused_naming_them():
    with pytest.raises(CheckpointEventError, match=r"extra lacks \['folder', 'parent'\]"):
        CheckpointEvent.from_extra({"weight_version": 1, "weights_sha256": SHA, "step": 1})
    with pytest.raises(CheckpointEventError, match="extra must be an object"):
        CheckpointEvent.from_extra(None)


def test_a_folder_outside_the_checkpoints_root_is_refused_naming_both(root, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (root / "step-000001").mkdir()
    assert loop.checked_folder(str(root / "step-000001"), root) == (root / "step-000001").resolve()
    assert loop.checked_folder(f"file://{root}/step-000001", root) == (root / "step-000001").resolve()
    for folder, why in [
        (str(tmp_path / "elsewhere"), f"is not below the deployment's checkpoints root {root}"),
        ("/etc", "is not below the deployment's checkpoints root"),
        (f"{root}/../elsewhere", "must be an absolute path without '..'"),
        ("step-000001", "must be an absolute path without '..'"),
        (f"{root}-sibling/step-000001", "is not below"),
    ]:
        with pytest.raises(CheckpointEventError) as refused:
            loop.checked_folder(folder, root)
        assert why in str(refused.value) and repr(folder) in str(refused.value)


def test_a_link_under_the_root_to_a_folder_outside_it_is_refused(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "step-000009").symlink_to(outside)
    with pytest.raises(CheckpointEventError, match="is not below the deployment's checkpoints root"):
        loop.checked_folder(str(root / "step-000009"), root)


def test_the_deployment_settings_are_required_and_checked(monkeypatch):
    monkeypatch.delenv(loop.CHECKPOINTS_ROOT_VARIABLE, raising=False)
    with pytest.raises(LoopConfigError, match=f"set {loop.CHECKPOINTS_ROOT_VARIABLE}"):
        loop.checkpoints_root()
    with pytest.raises(LoopConfigError, match="is not an absolute path"):
        loop.checkpoints_root({loop.CHECKPOINTS_ROOT_VARIABLE: "relative/ckpt"})
    assert loop.max_steps({}) == loop.DEFAULT_MAX_STEPS
    assert loop.max_steps({loop.MAX_STEPS_VARIABLE: "5"}) == 5
    for bad in ("0", "-1", "three"):
        with pytest.raises(LoopConfigError, match="max_steps is an integer >= 1"):
            loop.max_steps({loop.MAX_STEPS_VARIABLE: bad})


def test_a_run_without_an_event_is_refused_and_the_newest_of_several_is_taken():
    with pytest.raises(CheckpointEventError, match="a run conf cannot name a checkpoint"):
        loop.checkpoint_events({})
    with pytest.raises(CheckpointEventError, match="grpo_train trains on published datasets only"):
        loop.dataset_events(triggering("policy_checkpoint", extra()))
    events = loop.checkpoint_events(triggering("policy_checkpoint", extra(step=2), extra(step=3), extra(step=1)))
    assert loop.newest(events).step == 3


def test_a_checkpoint_is_verified_against_its_manifest_and_weights(root):
    zero, one = chain(root, 2)
    announced = {
        "weight_version": 1,
        "weights_sha256": one.weights_sha256,
        "step": 1,
        "folder": str(one.folder),
        "parent": {"folder": str(zero.folder), "weights_sha256": zero.weights_sha256},
    }
    verified = loop.verified_checkpoint(triggering("policy_checkpoint", announced))
    assert verified == announced | {"folder": str(one.folder.resolve())}

    with pytest.raises(CheckpointEventError, match=r"\['weights_sha256'\] differ from its checkpoint.json"):
        loop.verified_checkpoint(triggering("policy_checkpoint", announced | {"weights_sha256": zero.weights_sha256}))
    with pytest.raises(CheckpointEventError, match=r"\['weight_version'\] differ"):
        loop.verified_checkpoint(triggering("policy_checkpoint", announced | {"weight_version": 7}))


def test_a_checkpoint_whose_weights_changed_after_its_manifest_is_refused(root):
    from tasks.trainer.checkpoint import CheckpointWeightsMismatchError

    (zero,) = chain(root, 1)
    (zero.folder / "model.safetensors").write_bytes(b"other weights")
    announced = {
        "weight_version": 0,
        "weights_sha256": zero.weights_sha256,
        "step": 0,
        "folder": str(zero.folder),
        "parent": None,
    }
    with pytest.raises(CheckpointWeightsMismatchError, match="do not load it"):
        loop.verified_checkpoint(triggering("policy_checkpoint", announced))


def test_the_batch_is_planned_with_the_checkpoint_folder_which_the_policy_then_allows(root):
    from tasks.errors import TriggerPolicyError
    from tasks.trigger_policy import load_trigger_policy

    (zero,) = chain(root, 1)
    checkpoint = {"folder": str(zero.folder), "weight_version": 0, "step": 0}
    values = loop.batch_values({"num_tasks": 8, "model": "bundled:smollm2-135m-instruct"}, checkpoint)
    assert values == {"num_tasks": 8, "model": str(zero.folder), "weight_version": 0}
    policy = load_trigger_policy()
    with pytest.raises(TriggerPolicyError, match="a trigger picks one of"):
        policy.check_values(values)
    loop.checkpoint_policy(policy, checkpoint).check_values(values)
    with pytest.raises(CheckpointEventError, match="is not below the deployment's checkpoints root"):
        loop.checkpoint_policy(policy, {"folder": "/usr/share", "weight_version": 0})


def test_a_dataset_event_outside_the_policy_storage_is_refused(tmp_path):
    from tasks.errors import TriggerPolicyError

    inside = f"file://{tmp_path}/runs/batch-1/dataset"
    assert loop.dataset_batches([{"dataset": inside, "batch_id": "batch-1"}]) == ([inside[: -len("/dataset")]], None)
    with pytest.raises(TriggerPolicyError, match="a batch lives at or below one of"):
        loop.dataset_batches([{"dataset": "file:///etc/batches/x/dataset", "batch_id": "x"}])
    with pytest.raises(CheckpointEventError, match="is not a batch's dataset folder"):
        loop.dataset_batches([{"dataset": f"file://{tmp_path}/runs/batch-1", "batch_id": "x"}])


def test_at_max_steps_no_step_is_taken_and_nothing_is_announced(root, monkeypatch, tmp_path):
    from airflow.sdk.exceptions import AirflowSkipException

    chain(root, 3)
    monkeypatch.setenv(loop.MAX_STEPS_VARIABLE, "2")
    dataset = {"dataset": f"file://{tmp_path}/runs/b/dataset", "batch_id": "b"}
    trained = loop.train(triggering("grpo_dataset", dataset))
    assert not trained["trained"] and not trained["announce"] and trained["step"] == 2
    assert "max_steps 2 reached" in trained["said"] and "no policy_checkpoint event" in trained["said"]
    with pytest.raises(AirflowSkipException, match="no policy_checkpoint event: max_steps 2 reached"):
        loop.announce(trained)
    assert loop.announce({"announce": True, "checkpoint": extra()}) == extra()


REFIT_GRAPH = {
    "verify_checkpoint": set(),
    "refit": {"verify_checkpoint"},
    "plan": {"verify_checkpoint", "refit"},
    "generate": {"verify_checkpoint", "plan"},
    "validate_lineage": {"generate"},
    "finalize": {"validate_lineage"},
    "validate_dataset": {"finalize"},
    "review": {"validate_dataset"},
    "publish": {"review", "verify_checkpoint"},
    "sweep_orphans": {"plan", "publish"},
}


def test_the_loop_dags_are_scheduled_on_each_others_assets():
    from tasks.orchestration.local_airflow import dag_bag

    refit = dag_bag("policy_refit_batch.py").dags["policy_refit_batch"]
    assert {t.task_id: set(t.upstream_task_ids) for t in refit.tasks} == REFIT_GRAPH
    assert [asset.name for asset in refit.timetable.asset_condition.objects] == ["policy_checkpoint"]
    (published,) = refit.get_task("publish").outlets
    assert published.name == "grpo_dataset" and refit.max_active_runs == 1
    assert refit.params["engine"] == "vllm_server" and refit.params["engine_conn_id"] == "rollout_servers"
    assert refit.get_task("plan").is_setup and refit.get_task("sweep_orphans").is_teardown

    train = dag_bag("grpo_train.py").dags["grpo_train"]
    assert {t.task_id: set(t.upstream_task_ids) for t in train.tasks} == {
        "train": set(),
        "announce_checkpoint": {"train"},
    }
    assert [asset.name for asset in train.timetable.asset_condition.objects] == ["grpo_dataset"]
    assert train.max_active_runs == 1
    (announced,) = train.get_task("announce_checkpoint").outlets
    assert announced.name == "policy_checkpoint" and not train.params  # no run conf sets max_steps


def test_the_in_process_engine_has_nothing_to_refit_it_loads_the_checkpoint_folder(root):
    (zero,) = chain(root, 1)
    checkpoint = {"folder": str(zero.folder), "weight_version": 0, "step": 0, "weights_sha256": zero.weights_sha256}
    done = loop.refit({"engine": "vllm", "engine_conn_id": None}, checkpoint)
    assert done == {"engine": "vllm", "refit": "none: the engine loads the checkpoint folder itself"}
    from tasks.trigger_policy import load_trigger_policy

    policy = loop.checkpoint_policy(load_trigger_policy(), checkpoint)
    assert policy.allows_model(str(zero.folder)) and policy.allows_model(f"file://{zero.folder}")
