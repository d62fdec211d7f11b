"""The training step on a tiny policy: it trains a dataset its checkpoint sampled once, and refuses any other.

Datasets come from :class:`~tests.trainer.step_batches.TeacherForcedEngine` (scripted tokens, the policy's own
logprobs: whole vocabulary, or over scripted kept sets for top-p / top-k), planned, generated, finalized and
committed as publish commits them. The real-vLLM step (bundled model) is in test_step_e2e.py.
"""

from __future__ import annotations

import json

import pytest

from tasks.cli.main import main
from tasks.models.provenance import hashed_weights
from tasks.sampling import SamplingSettings
from tasks.trainer.checkpoint import checkpoint_chain, checkpoint_folders, checkpoint_zero, read_checkpoint
from tasks.trainer.step import (
    DatasetWeightsMismatchError,
    OffPolicyDatasetError,
    StepSettings,
    load_policy,
    train_step,
)
from tests.generation.fakes import FakeScriptedEngine
from tests.trainer.step_batches import TeacherForcedEngine, published_batch, tiny_model_folder

pytestmark = pytest.mark.slow
SETTINGS = StepSettings(lr=1e-3, threads=1)


def guess(request):
    return str(request.seed % 4 + 1)


@pytest.fixture(scope="module")
def batches(tmp_path_factory, tokenizer):
    """A tiny policy and four published batches: two it sampled (whole vocabulary; top-p / top-k kept sets), one
    another policy sampled, one whose logprobs are nobody's (the plain fake engine's)."""
    base = tmp_path_factory.mktemp("step")
    tiny = tiny_model_folder(base / "tiny")
    other = tiny_model_folder(base / "other", seed=1)
    policy, runs = load_policy(tiny), base / "runs"
    urls = {
        "on_policy": published_batch(runs, "b-on", tiny, TeacherForcedEngine(tokenizer, policy, reply=guess)),
        "kept_sets": published_batch(
            runs,
            "b-kept",
            tiny,
            TeacherForcedEngine(tokenizer, policy, reply=guess, masks=True),
            sampling=SamplingSettings(temperature=0.9, top_p=0.9, top_k=50, max_tokens=8),
        ),
        "other_weights": published_batch(
            runs, "b-other", other, TeacherForcedEngine(tokenizer, load_policy(other), reply=guess)
        ),
        "off_policy": published_batch(runs, "b-off", tiny, FakeScriptedEngine(tokenizer, reply=guess)),
    }
    return tiny, urls


@pytest.fixture
def root(batches, tmp_path):
    checkpoint_zero(batches[0], tmp_path / "ckpts")
    return tmp_path / "ckpts"


def test_a_step_trains_what_its_checkpoint_sampled_once_and_names_it(batches, root):
    _, urls = batches
    given = [urls["on_policy"], urls["kept_sets"]]
    result = train_step(root, given, SETTINGS)
    zero, one = checkpoint_chain(root)
    assert result.checkpoint == one and one.step == 1 and one.weight_version == 1
    assert one.weights_sha256 == hashed_weights(one.folder) != zero.weights_sha256
    assert one.manifest.parent.weights_sha256 == zero.weights_sha256
    assert [c.batch_url for c in one.manifest.consumed] == given
    assert {c.batch_id for c in one.manifest.consumed} == {"b-on", "b-kept"}
    print("step-0 ratio by dataset:", {u.rsplit("/", 1)[1]: vars(s) for u, s in result.ratio_by_dataset.items()})
    for stats in result.ratio_by_dataset.values():  # the same policy scored the tokens: ratio 1 to fp32 rounding
        assert abs(stats.mean - 1) < 1e-5 and stats.max_abs_log < 1e-5
    assert result.rows == 12 and result.tokens > 0 and result.loss is not None

    again = train_step(root, [*given, urls["on_policy"]], SETTINGS)
    assert again.checkpoint is None and [by for _, by in again.skipped] == ["step-000001"] * 3
    assert [p.name for p in checkpoint_folders(root)] == ["step-000000", "step-000001"]


def test_a_dataset_sampled_by_other_weights_is_refused(batches, root):
    _, urls = batches
    with pytest.raises(DatasetWeightsMismatchError, match="not checkpoint") as raised:
        train_step(root, [urls["on_policy"], urls["other_weights"]], SETTINGS)
    assert raised.value.reason == "dataset_weights_mismatch" and raised.value.exit_code == 3
    assert [p.name for p in checkpoint_folders(root)] == ["step-000000"]


def test_logprobs_the_checkpoint_did_not_give_are_refused_before_any_update(batches, root):
    _, urls = batches
    with pytest.raises(OffPolicyDatasetError, match="step-0 ratio is not 1") as raised:
        train_step(root, [urls["off_policy"]], SETTINGS)
    assert raised.value.reason == "step0_ratio_off" and raised.value.exit_code == 1
    assert [p.name for p in checkpoint_folders(root)] == ["step-000000"]
    assert read_checkpoint(root / "step-000000").weights_sha256 == hashed_weights(batches[0])


def test_the_cli_makes_checkpoint_zero_trains_and_says_what_it_skipped(batches, tmp_path, capsys):
    tiny, urls = batches
    out = tmp_path / "cli-ckpts"
    assert main(["train", "--checkpoints", str(out), "--batch-url", urls["on_policy"]]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["checkpoint-zero", "--model", str(tiny), "--out", str(out)]) == 0
    zero = json.loads(capsys.readouterr().out)
    assert zero["step"] == 0 and zero["weights_sha256"] == hashed_weights(tiny)
    refused = {"off_policy": (1, "step-0 ratio is not 1"), "other_weights": (3, "conflict: ")}
    for name, (code, said) in refused.items():
        assert main(["train", "--checkpoints", str(out), "--batch-url", urls[name], "--threads", "1"]) == code
        assert said in capsys.readouterr().err
    train = ["train", "--checkpoints", str(out), "--batch-url", urls["on_policy"], "--threads", "1"]
    assert main([*train, "--lr", "1e-3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 1 and summary["trained"][0]["batch_id"] == "b-on"
    assert abs(summary["step0_ratio"]["mean"] - 1) < 1e-5
    assert main(train) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["checkpoint"] is None and "already consumed by step-000001" in captured.err
