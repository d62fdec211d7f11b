"""Server faults at seeded moments of a shard over fake vLLM servers: after the retry rules, no row lost or mislabelled.

Each trial plans 8 guess_number rollouts (up to 4 turns, 4 at a time) on fake servers
(:mod:`tests.engines.fake_vllm_server`, which keep what truly answered each call), strikes one
fault at the seeded call, lets generate and its retry rules run (a failover, else a retry in a
new attempt as an orchestrator's), finalizes, and counts:

* rows lost: planned rollouts without a dataset row;
* rows labelled wrongly: rows with a call whose stamped weight version or finish differs from
  what answered it, or that the server answered after it restarted within the attempt that had
  connected to it before (its start-up weights taken as the attempt's).

Faults: ``restart`` (the only server restarts on its port between two calls of the rollout in
flight: a new process, same version name, reached over a new connection without any error),
``abort`` (the only server answers two calls ``abort``, as a shutdown or an abort-mode pause
does), ``dead_replica`` (one server of two is stopped mid-shard). Without the engine's identity
check the restart trials label every rollout after the restart wrongly. The default
run (``make test``) has one trial of each; ``SERVER_FAULT_TRIALS=N`` runs N.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from tasks.batch import Batch
from tasks.config import EngineSpec, StagingSpec
from tasks.errors import EngineDeadError
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shard
from tasks.plan import plan_batch
from tests.generation.configs import bundled_model_config
from tests.reliability.crash_trials import trial_count

from .fake_vllm_server import FakeVllmServer

pytestmark = [pytest.mark.slow]
TRIALS = trial_count("SERVER_FAULT_TRIALS", 1)
FAULTS = ("restart", "abort", "dead_replica")
MAX_RETRIES = 3  # an orchestrator's retries of the generate task


def strike_at(server: FakeVllmServer, call: int, fault, *, after_s: float = 0.0) -> threading.Thread:
    """Run ``fault()`` ``after_s`` seconds after ``server`` answered ``call`` generate calls."""

    def watch() -> None:
        while server.generated < call:
            time.sleep(0.002)
        time.sleep(after_s)
        fault()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def generate_with_retries(root: str, batch_id: str) -> int:
    """generate, and again after each engine death (at most :data:`MAX_RETRIES`); the attempts it took."""
    for _ in range(MAX_RETRIES + 1):
        try:
            return generate_shard(Batch.open(root, batch_id), 0, progress=False).attempt + 1
        except EngineDeadError:
            continue
    raise AssertionError(f"the shard was not committed in {MAX_RETRIES + 1} tries")


def measure(root: str, batch_id: str, servers: list[FakeVllmServer], first_identity: dict[str, str]) -> tuple[int, int]:
    """(rows lost, rows labelled wrongly) of the committed shard: see the module docstring."""
    batch = Batch.open(root, batch_id)
    staged = finalize_batch(batch, FinalizeOptions(audit=False))  # the fake's logprobs are no model's
    calls = batch.ledger(0).tables.calls.to_pylist()
    truth = {call_id: (server.url, *answer) for server in servers for call_id, answer in server.answered.items()}
    wrong: set[str] = set()
    for call in calls:
        url, identity, version, finish = truth[call["call_id"]]
        stamped = 0 if version == "default" else int(version)
        first_attempt = ".a00." in call["call_id"]
        restarted_under_it = first_attempt and identity != first_identity[url]
        if call["weight_version"] != stamped or call["finish_reason"] != finish or restarted_under_it:
            wrong.add(call["rollout_id"])
    return batch.config.num_rollouts - staged.marker.rows, len(wrong)


@pytest.mark.parametrize("trial", range(TRIALS))
@pytest.mark.parametrize("fault", FAULTS)
def test_a_server_fault_loses_no_row_and_labels_none_wrongly(fault: str, trial: int, tmp_path) -> None:
    seeded = random.Random(f"{fault}-{trial}")
    servers = [FakeVllmServer().start() for _ in range(2 if fault == "dead_replica" else 1)]
    try:
        for server in servers:
            server.delay_s = seeded.uniform(0.0, 0.03)
        first_identity = {server.url: server.identity for server in servers}
        options = {"urls": [server.url for server in servers]}
        engine = EngineSpec("vllm_server", options)
        config = bundled_model_config(batch_id=f"b-{fault}", num_tasks=4, max_in_flight=4, engine=engine)
        if fault == "restart":  # one rollout at a time, half a second between its calls: the restart (0.1 s after a
            # call, then a stop and a start of a few tens of ms) falls between calls
            config = bundled_model_config(
                batch_id=f"b-{fault}",
                num_tasks=2,
                max_in_flight=1,
                staging=StagingSpec(max_delay_ms=500.0),
                engine=engine,
            )
        root = str(tmp_path / "runs")
        plan_batch(Batch.open(root, config.batch_id), config)
        target, call = servers[-1], seeded.randint(2, 6)
        if fault == "restart":
            strike = strike_at(target, call, lambda: (target.stop(), target.start()), after_s=0.1)
        elif fault == "abort":
            target.abort_calls = range(call, call + 2)
            strike = None
        else:
            strike = strike_at(target, call, target.stop)
        attempts = generate_with_retries(root, config.batch_id)
        if strike is not None:
            strike.join(timeout=60)
        assert target.generated >= call, "the fault never struck"
        lost, wrong = measure(root, config.batch_id, servers, first_identity)
        print(f"fault trial {fault} {trial}: struck at call {call}, {attempts} attempt(s), {lost} lost, {wrong} wrong")
        assert (lost, wrong) == (0, 0)
    finally:
        for server in servers:
            if server.started:
                server.stop()
