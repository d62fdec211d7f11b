"""Real ``rollout-ledger serve`` processes lost mid-shard: a server restarted, a replica killed, calls aborted.

Both of the first two use one spare ``serve`` beside the test run's server, on the same key (a
``serve`` start is a large share of either test):

* One server restarted on its port while generate runs and while an engine is connected: ``serve``
  alone is SIGKILLed (its watchdog must take vLLM down and free the port), then a new ``serve`` takes
  the port at once: the calls in flight end the attempt as engine death (exit 1, no rollout
  poisoned); the connected engine's next call, answered by the new process, is refused as a
  restart; the retry refuses the restarted server's start-up version until it is named the
  planned one again; the next attempt's calls, aborted by a pause (below), end it too; the retry
  after it commits with every call stamped at the planned version.
* Two replicas (the test run's server and the spare); the spare's process group is SIGKILLed
  while ``rollout-ledger generate`` runs (as a shell's ``kill -9 -PGID``: vLLM runs in a group of
  its own, and ``serve``'s watchdog must take it down, port freed, nothing left): the rollouts
  whose calls it held start again on the first, in the same attempt, which commits; its dataset
  is validated and published; the summary names each rollout that failed over and the calls each
  replica answered, and status says the same.
* Calls aborted by a pause in abort mode (of the restarted server, in the first test) end the attempt as
  engine death, never a cut reply captured as ``stop``; the retry finishes the shard.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tasks.batch import Batch
from tasks.config import EngineSpec
from tasks.engines import create_engine
from tasks.engines.background import BackgroundLoop
from tasks.engines.base import GenerationRequest
from tasks.engines.vllm_server.replica import ReplicaDeadError
from tasks.engines.vllm_server.serving.launch import free_port
from tasks.errors import ConfigError
from tasks.finalize.stage import FinalizeOptions
from tasks.generate import generate_shard
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
from tasks.pipeline import finalize_and_publish
from tasks.sampling import SamplingSettings
from tasks.status.gather import batch_status
from tasks.status.render import render_status
from tasks.storage.claims import read_claims
from tests.serving import assert_reaped, name_weight_version, running

from .processes import GenerateProcess
from .test_interruptions_e2e import (
    assert_finished_without_duplicates,
    assert_stopped_cleanly,
    interruptible_config,
    planned,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]
PLANNED_VERSION = 2


class Serve:
    """``rollout-ledger serve`` of the bundled model on ``port``, the key in ``key_file``, in a session of its own."""

    def __init__(self, home: Path, key_file: str, port: int) -> None:
        argv = [sys.executable, "-m", "tasks.cli", "serve", "--port", str(port), "--api-key-file", key_file]
        argv += ["--engine-option", "max_model_len=2048", "--log", str(home / f"server-{port}.log")]
        self.stderr = home / f"serve-{port}.stderr"
        with self.stderr.open("a") as stderr:
            self.process = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True
            )
        self.url = self.process.stdout.readline().strip() if self.process.stdout else ""
        assert self.url.startswith("http://127.0.0.1:"), f"serve printed no URL:\n{self.stderr.read_text()[-3000:]}"

    def sigkill(self, *, group: bool) -> None:
        """SIGKILL ``serve`` alone, or its process group (``kill -9 -PGID``); nothing it started may be left and its
        port must be free within the reap time-out (vLLM runs in a group of its own: ``serve``'s watchdog ends it)."""
        started = psutil.Process(self.process.pid).children(recursive=True)
        assert len(started) >= 3, started  # the watchdog, vLLM's API server, its engine core
        killed_at = time.monotonic()
        if group:
            os.killpg(self.process.pid, signal.SIGKILL)
        else:
            self.process.kill()
        self.process.wait(timeout=30)
        seconds = assert_reaped(started, int(self.url.rpartition(":")[2]), killed_at=killed_at)
        print(f"nothing left of a SIGKILLed serve ({'its group' if group else 'alone'}) after {seconds:.1f} s")

    def stop(self) -> None:
        """SIGTERM, as a process manager stops it: it exits 0 and every process it started is gone."""
        started = psutil.Process(self.process.pid).children(recursive=True)
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=120) == 0, self.stderr.read_text()[-3000:]
        assert not [p.pid for p in started if running(p)], "processes of serve outlived its SIGTERM"


class Spare:
    """A ``serve`` on one port beside the test run's server, on its key; started again when a test left it dead."""

    def __init__(self, home: Path, key_file: str) -> None:
        self.home, self.key_file, self.port = home, key_file, free_port()
        self.serve: Serve | None = None

    def running(self) -> Serve:
        if self.serve is None or self.serve.process.poll() is not None:
            self.serve = Serve(self.home, self.key_file, self.port)
        return self.serve

    def restart(self) -> Serve:
        """A new ``serve`` on the same port (the old one must be gone)."""
        assert self.serve is not None and self.serve.process.poll() is not None, "the spare is still running"
        self.serve = Serve(self.home, self.key_file, self.port)
        return self.serve

    def stop(self) -> None:
        if self.serve is not None and self.serve.process.poll() is None:
            self.serve.stop()


def pause_until_it_ends(url: str, headers: dict[str, str], run: GenerateProcess, *, every_s: float = 5.0) -> None:
    """Pause the server in abort mode, again every ``every_s`` while ``run`` goes on (at most 120 s).

    A pause aborts every call the engine holds. One that falls between two calls finds none, and
    the next calls wait in vLLM's queue until a resume: the next pause aborts them."""
    deadline = time.monotonic() + 120
    while run.process.poll() is None and time.monotonic() < deadline:
        httpx.post(f"{url}/pause", params={"mode": "abort"}, headers=headers, timeout=120).raise_for_status()
        ends = time.monotonic() + every_s
        while run.process.poll() is None and time.monotonic() < ends:
            time.sleep(0.1)


@pytest.fixture(scope="module")
def spare(vllm_server, tmp_path_factory) -> Iterator[Spare]:
    spare = Spare(tmp_path_factory.mktemp("spare-serve"), vllm_server.key_file)
    try:
        yield spare
    finally:
        spare.stop()


def test_a_server_restarted_mid_shard_is_engine_death_and_nothing_is_stamped_with_its_start_up_version(
    vllm_server, spare, tmp_path
):
    key_file, key = vllm_server.key_file, vllm_server.key
    first = spare.running()
    loop = BackgroundLoop("restart-test")
    try:
        name_weight_version(first.url, key, PLANNED_VERSION)
        options = {"urls": [first.url], "api_key_file": key_file}
        model = resolve_model_reference(BUNDLED_REFERENCE)
        connected = loop.run(create_engine("vllm_server", model_path=model, options=options), timeout=300)
        text = connected.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Count to 3."}], tokenize=False, add_generation_prompt=True
        )
        prompt = tuple(connected.tokenizer.encode(text, add_special_tokens=False))
        request = GenerationRequest("c0", prompt, SamplingSettings(max_tokens=8), seed=1, session_id="r0")
        before = loop.run(connected.generate(request), timeout=300)
        assert {span.version for span in before.weight_spans} == {PLANNED_VERSION}

        engine = EngineSpec(name="vllm_server", options=options)
        config = interruptible_config("b-restart", weight_version=PLANNED_VERSION, engine=engine)
        root, store = planned(tmp_path, config)
        run = GenerateProcess(root, config.batch_id, tmp_path / "restart.log")
        done = run.wait_for_completed_rollouts()
        first.sigkill(group=False)
        assert_stopped_cleanly(run, store, 0, expected_code=1, reported_done=done)
        assert "the engine died" in run.log.read_text()

        restarted = spare.restart()  # the same port, a new process
        with pytest.raises(ReplicaDeadError, match="restarted"):
            loop.run(connected.generate(request), timeout=300)
        with pytest.raises(ConfigError, match=f"serves weight version 0, older than the planned {PLANNED_VERSION}"):
            generate_shard(Batch.open(root, config.batch_id), 0, progress=False)
        name_weight_version(restarted.url, key, PLANNED_VERSION)  # the operator refits it again

        # The next attempt after the killed one and the refused retry (each claimed one).
        aborted_attempt = max(c.attempt for c in read_claims(store, 0)) + 1
        aborted = GenerateProcess(root, config.batch_id, tmp_path / "abort.log")
        aborted_done = aborted.wait_for_completed_rollouts()
        headers = {"Authorization": f"Bearer {key}"}
        try:
            pause_until_it_ends(restarted.url, headers, aborted)
            assert_stopped_cleanly(aborted, store, aborted_attempt, expected_code=1, reported_done=aborted_done)
        finally:
            httpx.post(f"{restarted.url}/resume", headers=headers, timeout=120).raise_for_status()
        log = aborted.log.read_text()
        assert "aborted it after" in log and "the engine died" in log

        summary = generate_shard(Batch.open(root, config.batch_id), 0, progress=False)
        name_weight_version(restarted.url, key, 0)  # as the other tests of the spare plan
        loop.run(connected.close(), timeout=60)
    finally:
        loop.close()
    assert summary.rollouts == config.num_rollouts and summary.poisoned == 0
    assert summary.attempt == aborted_attempt + 1 and summary.adopted >= done + aborted_done
    assert_finished_without_duplicates(store, summary.ok, attempts=summary.attempt + 1)
    calls = Batch.open(root, config.batch_id).ledger(0).tables.calls
    assert set(calls.column("weight_version").to_pylist()) == {PLANNED_VERSION}
    assert "abort" not in calls.column("finish_reason").to_pylist()


def test_a_replica_killed_mid_shard_fails_over_to_the_other_and_the_dataset_is_published(vllm_server, spare, tmp_path):
    second = spare.running()
    options = vllm_server.engine_options() | {"urls": [vllm_server.url, second.url]}
    config = interruptible_config("b-failover", engine=EngineSpec(name="vllm_server", options=options))
    root, store = planned(tmp_path, config)
    run = GenerateProcess(root, config.batch_id, tmp_path / "failover.log")
    run.wait_for_completed_rollouts()
    second.sigkill(group=True)
    code, stdout = run.finish(timeout=900)

    log = run.log.read_text()
    assert code == 0, log[-3000:]
    (summary,) = json.loads(stdout)
    assert summary["attempt"] == 0 and summary["failovers"]
    assert all(f.startswith("rollout ") and f"server {second.url}" in f for f in summary["failovers"])
    assert summary["calls_by_replica"][vllm_server.url] > 0 and summary["calls_by_replica"][second.url] > 0
    assert summary["rollouts"] == config.num_rollouts and summary["poisoned"] == summary["failed"] == 0
    assert "starts again from its first turn on a live one, replaying the calls it committed" in log
    assert "failed over: rollout" in log
    # Each rollout restarted on the live server replayed what it had committed and sampled from the lost call on.
    assert summary["resumed"] == len(summary["failovers"]) and summary["divergences"] == 0
    assert summary["live_calls"] >= summary["resumed"]
    assert_finished_without_duplicates(store, summary["ok"], attempts=1)
    status = batch_status(Batch.open(root, config.batch_id))
    committed = status.shards[0].committed
    assert committed.failovers == () and committed.rollouts_failed_over == len(summary["failovers"])
    assert committed.calls_by_server[second.url] > 0
    assert (committed.resumed.rollouts, committed.resumed.replayed_calls) == (
        summary["resumed"],
        summary["replayed_calls"],
    )
    assert f"{len(summary['failovers'])} rollout(s) restarted on a live server" in render_status(status)
    published = finalize_and_publish(Batch.open(root, config.batch_id), FinalizeOptions(audit=False))
    assert published.published is not None and published.staged.marker.rows == config.num_rollouts
