"""kill -9 of a real ``rollout-ledger generate`` process at seeded crash points; the retry loses nothing.

Each trial plans one batch of its environment kind on the test run's vLLM server (engine ``vllm_server``), runs generate
armed with its crash point until SIGKILL ends it, retries the shard (a new attempt, as a retry
anywhere is; the Airflow way is ``tests/orchestration/test_crash_trials_e2e.py``), runs the
suites, finalize and publish, and
checks :func:`crash_trials.check_survivors`. Trials
0-5 and 12-17 store on local disk, 6-11 on S3 (moto). The default run has one trial; ``make
crash-trials`` runs the full count (with the ``rollout_batch`` DAG trials of
``tests/orchestration/test_crash_trials_e2e.py``).
"""

from __future__ import annotations

import dataclasses
import signal

import pytest

from tasks.batch import Batch
from tasks.config import EngineSpec
from tasks.crash_points import CRASH_AT_VARIABLE
from tasks.generate import generate_shard
from tasks.plan import plan_batch
from tests.generation.configs import bundled_model_config
from tests.generation.processes import GenerateProcess
from tests.reliability.crash_trials import (
    CALLS_AT_ONCE,
    ENVIRONMENTS,
    Trial,
    check_survivors,
    finish_batch,
    first_attempt_objects,
    killed_attempt_calls,
    reference_rows,
    trial_count,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.crash_trials]
TRIALS = trial_count("CRASH_TRIALS_CLI", 1)


@pytest.fixture(scope="module")
def planned(vllm_server):
    """The plan of each environment kind's trials: 8 rollouts in one shard, four at a time."""
    engine = EngineSpec(name="vllm_server", options=vllm_server.engine_options())
    return {
        kind: bundled_model_config(
            batch_id=f"crash-{kind.replace('_', '-')}", num_tasks=4, max_in_flight=4, engine=engine, **fields
        )
        for kind, fields in ENVIRONMENTS.items()
    }


@pytest.mark.parametrize("seed", range(TRIALS))
def test_a_generate_process_killed_at_a_crash_point_is_retried_without_losing_a_rollout(
    seed, planned, tmp_path, request
):
    trial = Trial.of_seed(seed, tmp_path / "crashed")
    print(trial)
    config = dataclasses.replace(planned[trial.environment], batch_id=f"crash-{seed}")
    root = request.getfixturevalue("s3_bucket") + "/runs" if (seed // 6) % 2 else str(tmp_path / "runs")
    plan_batch(Batch.open(root, config.batch_id), config)
    store = Batch.open(root, config.batch_id).store

    first = GenerateProcess(
        root, config.batch_id, tmp_path / "first.log", env={CRASH_AT_VARIABLE: trial.crash.to_json()}
    )
    code, _ = first.finish(timeout=600)
    assert code == -signal.SIGKILL, f"{trial}: exit {code}:\n{first.log.read_text()[-3000:]}"
    assert (tmp_path / "crashed").exists(), f"{trial}: killed, but not by its crash point"
    assert not first.session_survivors(grace=30), f"{trial}: engine processes outlived the killed generate"
    crashed = first_attempt_objects(store)
    killed_calls = killed_attempt_calls(store)

    generate_shard(Batch.open(root, config.batch_id), 0, progress=False)
    finish_batch(root, config.batch_id)
    clean_run = reference_rows(str(tmp_path / "clean"), Batch.open(root, config.batch_id).config)  # as planned
    calls_at_once = CALLS_AT_ONCE.get(trial.environment, 1)
    check_survivors(Batch.open(root, config.batch_id), crashed, clean_run, killed_calls, calls_at_once=calls_at_once)
