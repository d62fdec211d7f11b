"""A vLLM server that dies mid-shard ends the attempt without poisoning a rollout; the retry adopts and finishes.

``rollout-ledger generate`` (engine ``vllm_server``) calls the test run's real server through a
:class:`~tests.generation.dying_proxy.DyingProxy`; killing the proxy resets every connection
mid-answer as a killed server does. The attempt exits 1 naming the dead server, with no shard
marker and no ``engine_error`` rollout; once the "server" listens again the retry adopts every
completed rollout and commits the shard.
"""

from __future__ import annotations

import pytest

from tasks.batch import Batch
from tasks.config import EngineSpec
from tasks.generate import generate_shard

from .dying_proxy import DyingProxy
from .processes import GenerateProcess
from .test_interruptions_e2e import (
    assert_finished_without_duplicates,
    assert_stopped_cleanly,
    interruptible_config,
    planned,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_server_that_dies_mid_shard_poisons_nothing_and_the_retry_finishes_the_shard(vllm_server, tmp_path):
    proxy = DyingProxy(vllm_server.url)
    proxy.start()
    engine = EngineSpec(name="vllm_server", options=vllm_server.engine_options() | {"urls": [proxy.url]})
    config = interruptible_config("b-server-death", engine=engine)
    root, store = planned(tmp_path, config)

    run = GenerateProcess(root, config.batch_id, tmp_path / "died.log")
    done = run.wait_for_completed_rollouts()
    proxy.kill()
    assert_stopped_cleanly(run, store, 0, expected_code=1, reported_done=done)
    log = run.log.read_text()
    assert "the engine died" in log and f"server {proxy.url} is unreachable" in log

    proxy.start()
    try:
        summary = generate_shard(Batch.open(root, config.batch_id), 0, progress=False)
    finally:
        proxy.kill()
    assert summary.attempt == 1 and summary.adopted >= done
    assert summary.poisoned == 0 and summary.rollouts == config.num_rollouts
    assert_finished_without_duplicates(store, summary.ok, attempts=2)
