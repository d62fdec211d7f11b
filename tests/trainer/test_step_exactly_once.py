"""Exactly once under SIGKILL: a trainer killed at random moments and restarted trains every dataset once.

A clean chain first (in this process): checkpoint 0 of a tiny policy, then for k = 1..3 a dataset sampled by
checkpoint k-1 (its own logprobs, :class:`~tests.trainer.step_batches.TeacherForcedEngine`) and a step on it. The
trial then starts from a copy of checkpoint 0 in another root: a trainer process (:mod:`tests.trainer.step_trial`)
steps through the three datasets and is SIGKILLed at a random moment after its imports (uniform over the work
the run has left), again and again, then left to finish. After every kill every ``step-NNNNNN`` folder is a whole
checkpoint (weights hash to its manifest, the chain links hold); at the end the chain consumed each dataset exactly
once, in order, and its weights are the clean chain's, hash for hash (a dataset trained twice, or a torn write,
would change them; a skipped one would stop the chain, as the next dataset's weights check refuses it).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.trainer.checkpoint import checkpoint_chain, checkpoint_folders, checkpoint_zero, read_checkpoint
from tasks.trainer.step import load_policy, train_step
from tests.trainer.step_batches import TeacherForcedEngine, published_batch, tiny_model_folder
from tests.trainer.step_trial import TRIAL_SETTINGS

pytestmark = [pytest.mark.slow, pytest.mark.crash_trials, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]
DATASETS = 3
KILLS = int(os.environ.get("STEP_TRIAL_KILLS", "2"))  # `make crash-trials` kills 10 times
SEED = int(os.environ.get("STEP_TRIAL_SEED", "47"))


@pytest.fixture(scope="module")
def clean_chain(tmp_path_factory, tokenizer):
    base = tmp_path_factory.mktemp("exactly-once")
    tiny = tiny_model_folder(base / "tiny")
    clean = base / "clean"
    checkpoint_zero(tiny, clean)
    urls = []
    for k in range(1, DATASETS + 1):
        latest = checkpoint_chain(clean)[-1]
        engine = TeacherForcedEngine(
            tokenizer, load_policy(latest.folder), reply=lambda r: str(r.seed % 4 + 1), weight_version=k - 1
        )
        urls.append(published_batch(base / "runs", f"b-{k}", latest.folder, engine, weight_version=k - 1))
        train_step(clean, [urls[-1]], TRIAL_SETTINGS)
    return tiny, urls, checkpoint_chain(clean)


PHASES = (  # the step's log lines, in order, and where a kill after each one landed
    ("latest checkpoint", "reading the chain and the dataset"),
    ("trainable", "loading the policy"),
    ("training on", "in forward/backward"),
    ("step-0 ratio", "in the optimizer step or writing the checkpoint"),
    ("wrote checkpoint", "after the rename"),
    ("done in", "between steps"),
)


def phase(log: str) -> str:
    """Where the trainer was when killed, from its last step log line."""
    lines = [line for line in log.splitlines() if " tasks.trainer." in line]
    if not lines:
        return "before its first step's first line"
    return next((where for key, where in reversed(PHASES) if key in lines[-1]), lines[-1][-60:])


def start_trainer(root: Path, urls: list[str], stderr) -> subprocess.Popen:
    """A trainer process over ``urls``, returned once it said ``ready`` (its imports done)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.trainer.step_trial", str(root), *urls],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    assert process.stdout.readline().strip() == "ready"
    return process


def whole_checkpoints(root: Path) -> None:
    """Every step folder is a complete checkpoint and the chain's links hold."""
    for folder in checkpoint_folders(root):
        read_checkpoint(folder)
    checkpoint_chain(root)


def test_a_trainer_killed_at_random_moments_trains_every_dataset_exactly_once(clean_chain, tmp_path):
    tiny, urls, clean = clean_chain
    timing = tmp_path / "timing"  # one unkilled run: how long the work after the imports takes in a process
    checkpoint_zero(tiny, timing)
    process = start_trainer(timing, urls, subprocess.DEVNULL)
    started = time.monotonic()
    assert process.wait(timeout=600) == 0 and process.stdout.read().split() == ["done"]
    window = time.monotonic() - started  # the kill moment is uniform over the work of a whole run
    root = tmp_path / "trial"
    checkpoint_zero(tiny, root)
    rng = random.Random(SEED)
    kills, starts, last_lines = 0, 0, []
    while True:
        starts += 1
        log = tmp_path / f"run-{starts}.log"
        with log.open("w") as err:
            process = start_trainer(root, urls, err)
            done = len(checkpoint_folders(root)) - 1  # the work left shrinks as steps land: so does the window
            left = window * (DATASETS - done) / DATASETS
            delay = rng.uniform(0, left) if kills < KILLS and done < DATASETS else None
            try:
                process.wait(timeout=delay if delay is not None else 600)
            except subprocess.TimeoutExpired:
                if delay is None:
                    process.kill()
                    raise
                process.send_signal(signal.SIGKILL)
                process.wait()
                kills += 1
                torn = any(p.name.startswith(".step-") for p in root.iterdir())
                last_lines.append((len(checkpoint_folders(root)) - 1, phase(log.read_text()), torn))
                whole_checkpoints(root)
                continue
            out = process.stdout.read()
        if process.returncode == 0 and out.split() == ["done"]:
            break
        pytest.fail(f"the trainer exited {process.returncode}: {log.read_text()[-3000:]}")
    chain = checkpoint_chain(root)
    consumed = [[c.batch_url for c in cp.manifest.consumed] for cp in chain[1:]]
    print(
        f"\nexactly-once trial: {DATASETS} datasets, {kills} SIGKILLs at uniform moments of a {window:.1f} s run, "
        f"{starts} starts ({starts - 1} restarts)"
    )
    for index, (steps, where, torn) in enumerate(last_lines, 1):
        left = "an unfinished checkpoint folder" if torn else "no unfinished folder"
        print(f"  kill {index}: {steps} step(s) on disk, killed {where}; left {left}")
    assert consumed == [[url] for url in urls], "every dataset exactly once, in order"
    assert [c.weights_sha256 for c in chain] == [c.weights_sha256 for c in clean], "the clean chain's weights"
    assert [c.weight_version for c in chain] == list(range(DATASETS + 1))
    assert not [p for p in root.iterdir() if p.name.startswith(".step-")], "no unfinished folder left behind"
    assert kills >= KILLS // 2, "too few runs were killed before they finished"
