"""Real ``rollout-ledger generate`` processes stopped the ways orchestrators stop them.

Ctrl-C to the whole process group (the in-process engine's processes get it too), a kill of the
engine process alone, SIGTERM to the process (on the test run's vLLM server; the handler is
the one of Ctrl-C), and the vLLM server dying mid-shard (a :class:`~tests.generation.dying_proxy.DyingProxy`
in front of it: killing the proxy resets every connection mid-answer, as a killed server does) each end the
attempt without a shard marker, with a non-zero exit (1 naming the dead server for the last), with no
engine process left behind, and without poisoning a single rollout (no ``engine_error`` rollout); the
retry adopts every completed rollout and finishes the shard. Each test stops two attempts of one batch
in turn (the second resumes what the first left), then retries once. Two generate processes started on
one shard at once (both calling the test run's vLLM server) commit it exactly once, at the planned
weight version.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.batch import Batch
from tasks.config import BatchConfig, EngineSpec
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shard
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tasks.storage.claims import read_claims
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.marker import read_marker
from tasks.storage.objects import ObjectStore
from tasks.storage.recovery import read_uncommitted_attempt
from tasks.storage.sweep import sweep_orphans

from .chains import verified_sequences
from .configs import bundled_model_config
from .dying_proxy import DyingProxy
from .processes import GenerateProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def interruptible_config(batch_id: str, **overrides) -> BatchConfig:
    """8 short rollouts, four at a time (a vLLM-CPU step costs about the same for one call or four): an attempt
    outlasts several progress lines (every second in tests), so a test sees some rollouts done and stops it midway."""
    return bundled_model_config(
        **{
            "batch_id": batch_id,
            "num_tasks": 4,
            "max_turns": 3,
            "sampling": SamplingSettings(max_tokens=16),
            "max_in_flight": 4,
        }
        | overrides
    )


def planned(tmp_path: Path, config: BatchConfig) -> tuple[str, ObjectStore]:
    """Plan ``config`` under ``tmp_path/runs``; the root URL and the batch's store."""
    root = str(tmp_path / "runs")
    batch = Batch.open(root, config.batch_id)
    plan_batch(batch, config)
    return root, batch.store


def assert_stopped_cleanly(
    run: GenerateProcess, store, attempt: int, *, expected_code: int, reported_done: int
) -> None:
    code, _ = run.finish()
    log = run.log.read_text()
    assert code == expected_code, f"exit {code}, expected {expected_code}:\n{log[-3000:]}"
    assert not run.session_survivors(), "engine processes outlived the generate process"
    assert read_marker(store, 0) is None, "an interrupted attempt must not commit the shard"
    left = read_uncommitted_attempt(store, 0, attempt)
    assert len(left.rollouts) >= reported_done, "completed rollouts' receipts were not flushed"
    assert not [b.receipt for b in left.rollouts if b.receipt.failure_reason == "engine_error"]
    assert not [f for b in left.rollouts for f in b.failures if f.reason == "engine_error"]
    assert "Traceback" not in log.split("engine log:")[0]


def test_ctrl_c_and_an_engine_kill_never_poison_a_shard_and_the_retry_finishes_it(vllm_engine, tmp_path):
    config = interruptible_config("b-interrupt")
    root, store = planned(tmp_path, config)

    ctrl_c = GenerateProcess(root, config.batch_id, tmp_path / "int.log")
    done = ctrl_c.wait_for_completed_rollouts()
    assert ctrl_c.engine_processes()
    os.killpg(ctrl_c.process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert_stopped_cleanly(ctrl_c, store, 0, expected_code=128 + signal.SIGINT, reported_done=done)
    assert "Loading safetensors" not in ctrl_c.log.read_text()  # an engine's own output goes to its log file

    engine_kill = GenerateProcess(root, config.batch_id, tmp_path / "kill.log")
    done = engine_kill.wait_for_completed_rollouts()
    for engine_process in engine_kill.engine_processes():
        if "EngineCore" in engine_process.name():
            engine_process.kill()
    assert_stopped_cleanly(engine_kill, store, 1, expected_code=1, reported_done=done)
    assert "the engine died" in engine_kill.log.read_text()

    engine, loop = vllm_engine
    summary = generate_shard(Batch.open(root, config.batch_id), 0, engine=engine, run=loop.run, progress=False)
    assert summary.attempt == 2 and summary.adopted > 0
    assert_finished_without_duplicates(store, summary.ok, attempts=3)
    assert summary.poisoned == 0 and summary.rollouts == config.num_rollouts


def test_sigterm_and_a_server_that_dies_mid_shard_end_their_attempts_cleanly_and_the_retry_finishes_the_shard(
    tmp_path, vllm_server
):
    """Attempt 0 gets SIGTERM; attempt 1 loses its server (the proxy dies mid-answer); once the "server" listens
    again, the retry adopts every rollout either completed and commits the shard."""
    proxy = DyingProxy(vllm_server.url)
    proxy.start()
    engine = EngineSpec(name="vllm_server", options=vllm_server.engine_options() | {"urls": [proxy.url]})
    config = interruptible_config("b-sigterm", engine=engine)
    root, store = planned(tmp_path, config)

    term = GenerateProcess(root, config.batch_id, tmp_path / "term.log")
    term_done = term.wait_for_completed_rollouts()
    term.process.send_signal(signal.SIGTERM)
    assert_stopped_cleanly(term, store, 0, expected_code=128 + signal.SIGTERM, reported_done=term_done)
    assert "stopped by SIGTERM" in term.log.read_text()

    died = GenerateProcess(root, config.batch_id, tmp_path / "died.log")
    died_done = died.wait_for_completed_rollouts()
    proxy.kill()
    assert_stopped_cleanly(died, store, 1, expected_code=1, reported_done=died_done)
    log = died.log.read_text()
    assert "the engine died" in log and f"server {proxy.url} is unreachable" in log

    proxy.start()
    try:
        summary = generate_shard(Batch.open(root, config.batch_id), 0, progress=False)
    finally:
        proxy.kill()
    assert summary.attempt == 2 and summary.adopted >= term_done + died_done
    assert summary.poisoned == 0 and summary.rollouts == config.num_rollouts
    assert_finished_without_duplicates(store, summary.ok, attempts=3)


def assert_finished_without_duplicates(store, ok: int, *, attempts: int) -> None:
    """The shard holds one receipt per rollout, every ok rollout verifies, and each attempt claimed once."""
    receipts = LedgerReader(store, 0).receipts
    assert sorted(r.rollout_id for r in receipts) == sorted({r.rollout_id for r in receipts})
    assert len(verified_sequences(store, 0)) == ok
    assert [c.attempt for c in read_claims(store, 0)] == list(range(attempts))


def test_two_generate_processes_on_one_shard_commit_it_once_at_the_planned_weight_version(tmp_path, vllm_server):
    """Both call the test run's vLLM server (named weight version 3, as a trainer's refit would)."""
    engine = EngineSpec(name="vllm_server", options=vllm_server.engine_options())
    config = interruptible_config("b-race", num_tasks=2, max_in_flight=4, weight_version=3, engine=engine)
    root, store = planned(tmp_path, config)
    with vllm_server.at_weight_version(3):
        first = GenerateProcess(root, config.batch_id, tmp_path / "a.log")
        time.sleep(0.2)
        second = GenerateProcess(root, config.batch_id, tmp_path / "b.log")
        outcomes = []
        for run in (first, second):
            code, stdout = run.finish(timeout=600)
            assert code == 0, run.log.read_text()[-3000:]
            (summary,) = json.loads(stdout)
            outcomes.append(summary)
    assert sorted(s["already_committed"] for s in outcomes) == [False, True]
    assert outcomes[0]["attempt"] == outcomes[1]["attempt"]
    assert {c.attempt for c in read_claims(store, 0)} == {0, 1}
    marker = read_marker(store, 0)
    assert marker is not None and marker.counts.rollouts == config.num_rollouts
    sweep_orphans(store, 0)
    assert sweep_orphans(store, 0, dry_run=True).orphans == ()
    finalize_batch(Batch.open(root, config.batch_id), FinalizeOptions(audit=False))
    rows = [
        r
        for part in sorted(Path(store.full_path("dataset")).glob("part-*.parquet"))
        for r in pq.read_table(part).to_pylist()
    ]
    assert sorted(r["rollout_id"] for r in rows) == sorted({r["rollout_id"] for r in rows})
    assert len(rows) == config.num_rollouts
    assert {(r["weight_version_min"], r["weight_version_max"]) for r in rows if r["sample_mask"]} == {(3, 3)}
