"""Engine ``vllm_server`` over fake servers (:mod:`tests.engines.fake_vllm_server`): replica life and failover.

Real HTTP, fake model: a server restarted between calls (a new start identity, its start-up
weights) and one whose weight version goes down are lost, never stamped; an ``abort`` finish
loses the replica too; every call names its rollout in ``X-Session-ID``; replicas caught
mid-refit are read again until they agree; and a shard whose replica starts aborting mid-shard
fails over to the other and commits a valid dataset, its summary and status naming the failover.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator

import pytest

from tasks.batch import Batch
from tasks.config import EngineSpec
from tasks.engines import create_engine
from tasks.engines.base import GenerationRequest
from tasks.engines.vllm_server.claims import ReplicasMidRefitError, read_claims
from tasks.engines.vllm_server.replica import ReplicaDeadError
from tasks.errors import ConfigError, EngineDeadError, EngineError
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shard
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tasks.status.gather import batch_status
from tasks.status.render import render_status
from tasks.status.shards import failed_over
from tasks.storage.claims import AttemptClaim
from tests.generation.configs import bundled_model_config

from .fake_vllm_server import MODEL, FakeVllmServer


@pytest.fixture
def servers() -> Iterator[list[FakeVllmServer]]:
    started = [FakeVllmServer(weight_version="3").start(), FakeVllmServer(weight_version="3").start()]
    yield started
    for server in started:
        server.stop()


def request(engine, index: int, session: str | None = None) -> GenerationRequest:
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Say {index}."}], tokenize=False, add_generation_prompt=True
    )
    prompt = tuple(engine.tokenizer.encode(text, add_special_tokens=False))
    return GenerationRequest(f"c{index}", prompt, SamplingSettings(max_tokens=8), seed=index, session_id=session)


def options(*servers: FakeVllmServer) -> dict:
    """Engine options on fake servers, whose weights (beyond version 0, unrecorded) are declared by name."""
    return {"urls": [server.url for server in servers], "served_model": str(MODEL)}


async def connect(*servers: FakeVllmServer):
    return await create_engine("vllm_server", model_path=MODEL, options=options(*servers))


def test_a_server_restarted_between_calls_is_lost_and_never_stamped_with_its_start_up_version(servers) -> None:
    server = servers[0]

    async def restart_between_calls():
        engine = await connect(server)
        try:
            before = await engine.generate(request(engine, 0, "r0"))
            server.stop()
            server.start()  # same port, a new process: weights named "default" again
            with pytest.raises(ReplicaDeadError, match="restarted") as lost:
                await engine.generate(request(engine, 1, "r0"))
            with pytest.raises(EngineDeadError, match=r"every server is lost: .* restarted"):  # and stays lost
                await engine.generate(request(engine, 2, "r1"))
            return before, lost.value, engine.survives(lost.value), engine.calls_by_replica()
        finally:
            await engine.close()

    before, lost, survives, calls = asyncio.run(restart_between_calls())
    assert [span.version for span in before.weight_spans] == [3]
    assert lost.url == server.url and not survives  # its only replica: the attempt ends, the retry rules apply
    assert calls == {server.url: 1} and server.generated == 2  # the restarted server's answer was not taken


def test_a_weight_version_that_goes_down_loses_the_replica(servers) -> None:
    server = servers[0]

    async def rolled_back():
        engine = await connect(server)
        try:
            await engine.generate(request(engine, 0))
            server.weight_version = "2"  # the same process, an older version: a rollback
            await engine.generate(request(engine, 1))
        finally:
            await engine.close()

    with pytest.raises(ReplicaDeadError, match=r"weight version\(s\) \[2\] after serving version 3"):
        asyncio.run(rolled_back())


def test_an_abort_finish_loses_the_replica_and_its_rollouts_move_to_the_other(servers) -> None:
    dying, live = servers

    async def abort_then_move():
        engine = await connect(dying, live)
        try:
            pinned = {engine._replica_for(f"r{i}").url: f"r{i}" for i in range(20)}
            session = pinned[dying.url]
            dying.finish_reason = "abort"
            with pytest.raises(ReplicaDeadError, match="aborted it") as lost:
                await engine.generate(request(engine, 0, session))
            assert engine.survives(lost.value)
            moved = await engine.generate(request(engine, 1, session))
            return moved, engine.calls_by_replica()
        finally:
            await engine.close()

    moved, calls = asyncio.run(abort_then_move())
    assert moved.metadata["server"] == live.url and calls == {dying.url: 0, live.url: 1}


def test_a_server_error_from_a_server_whose_engine_is_gone_loses_it_and_from_a_healthy_one_fails_the_call(
    servers,
) -> None:
    server = servers[0]

    async def engine_gone():
        engine = await connect(server)
        try:
            server.engine_dead = True
            with pytest.raises(ReplicaDeadError, match="/health answers HTTP 503: its engine is gone"):
                await engine.generate(request(engine, 0))
        finally:
            await engine.close()

    asyncio.run(engine_gone())
    server.engine_dead = False

    async def one_call_refused():
        engine = await connect(server)
        try:
            server.refuse_status = 500  # its /health still answers 200: the call's own failure
            with pytest.raises(EngineError, match="answered HTTP 500") as failed:
                await engine.generate(request(engine, 0))
            return failed.value, engine.replicas[0].lost
        finally:
            await engine.close()

    failed, lost = asyncio.run(one_call_refused())
    assert not isinstance(failed, EngineDeadError) and lost is None


def test_every_call_names_its_rollout_in_x_session_id_and_idle_replicas_share_new_rollouts(servers) -> None:
    async def many_rollouts():
        engine = await connect(*servers)
        try:
            return await asyncio.gather(*(engine.generate(request(engine, i, f"rollout-{i}")) for i in range(8)))
        finally:
            await engine.close()

    results = asyncio.run(many_rollouts())
    assert all(server.generated > 0 for server in servers)
    assert sorted(s for server in servers for s in server.sessions) == sorted(f"rollout-{i}" for i in range(8))
    for result in results:
        server = next(s for s in servers if s.url == result.metadata["server"])
        assert f"rollout-{result.request_id.removeprefix('c')}" in server.sessions


def test_replicas_mid_refit_are_read_again_until_they_agree(servers, caplog) -> None:
    from tasks.engines.vllm_server.claims import replicas_of
    from tasks.engines.vllm_server.options import VllmServerOptions

    first, second = servers
    first.paused, second.weight_version = True, "2"  # a rolling refit: the first paused, the second behind

    def refit_ends() -> None:
        first.paused, second.weight_version = False, "3"

    async def read(wait_s: float):
        replicas = replicas_of(VllmServerOptions(urls=[first.url, second.url]))
        try:
            return await read_claims(replicas, wait_s=wait_s, poll_s=0.2)
        finally:
            await asyncio.gather(*(replica.close() for replica in replicas))

    with pytest.raises(ReplicasMidRefitError, match=r"stayed mid-refit .*version 3 \(paused\).*version 2") as waited:
        asyncio.run(read(0.5))
    assert waited.value.retryable and not isinstance(waited.value, ConfigError)

    timer = threading.Timer(1.0, refit_ends)
    timer.start()
    with caplog.at_level(logging.INFO, logger="tasks.engines.vllm_server.claims"):
        claims = asyncio.run(read(30))
    timer.join()
    assert [claim.weight_version for claim in claims] == [3, 3] and not any(claim.paused for claim in claims)
    assert "the servers are mid-refit" in caplog.text


def test_a_shard_whose_replica_starts_aborting_fails_over_and_commits_a_valid_dataset(servers, tmp_path) -> None:
    dying, live = servers
    dying.abort_calls = range(4, 10**6)  # from its 4th call on, every answer is cut: a server shutting down
    for server in servers:
        server.weight_version = "default"  # its start-up weights: the planned folder, verified
        server.delay_s = 0.05  # calls overlap, so the abort finds rollouts in flight on both
    engine = EngineSpec(name="vllm_server", options=options(dying, live))
    config = bundled_model_config(batch_id="b-failover", num_tasks=4, max_in_flight=4, engine=engine)
    root = str(tmp_path / "runs")
    plan_batch(Batch.open(root, config.batch_id), config)

    summary = generate_shard(Batch.open(root, config.batch_id), 0, progress=False)

    # The rollouts whose calls it cut start again on the live one, in the same attempt.
    assert summary.attempt == 0 and summary.failovers
    assert all(f.startswith("rollout ") and f"server {dying.url} aborted" in f for f in summary.failovers)
    assert summary.calls_by_replica[dying.url] == 3 and summary.calls_by_replica[live.url] > 0
    assert summary.rollouts == config.num_rollouts and summary.poisoned == 0 and summary.failed == 0
    staged = finalize_batch(Batch.open(root, config.batch_id), FinalizeOptions(audit=False))  # fake logprobs
    assert staged.marker.rows == config.num_rollouts and staged.marker.trainable_rows == config.num_rollouts
    ledger = Batch.open(root, config.batch_id).ledger(0)
    assert set(ledger.tables.calls.column("weight_version").to_pylist()) == {0}
    status = batch_status(Batch.open(root, config.batch_id))
    committed = status.shards[0].committed
    assert committed.failovers == () and committed.rollouts_failed_over == len(summary.failovers)
    assert f"staged rows; {len(summary.failovers)} rollout(s) restarted on a live server" in render_status(status)


def test_an_agent_shard_whose_replica_is_lost_goes_on_in_a_new_attempt(servers, tmp_path) -> None:
    """An agent's call cannot be restarted under its running agent: the attempt ends and a new one adopts."""
    dying, live = servers
    dying.abort_calls = range(3, 10**6)
    for server in servers:
        server.weight_version, server.delay_s = "default", 0.05
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"a": i, "b": 1}) + "\n" for i in range(8)))
    environment = {"function": "tests.generation.agents_for_tests:tool_agent", "tasks": str(tasks)}
    config = bundled_model_config(
        batch_id="b-agent-failover",
        environment="agent_callable",
        environment_options=environment,
        num_tasks=8,
        group_size=1,
        max_in_flight=4,
        engine=EngineSpec(name="vllm_server", options=options(dying, live)),
    )
    root = str(tmp_path / "runs")
    plan_batch(Batch.open(root, config.batch_id), config)

    summary = generate_shard(Batch.open(root, config.batch_id), 0, progress=False)

    assert summary.attempt == 1 and len(summary.failovers) == 1 and summary.failovers[0].startswith("attempt 0: ")
    assert summary.rollouts == config.num_rollouts and summary.poisoned == summary.failed == 0
    staged = finalize_batch(Batch.open(root, config.batch_id), FinalizeOptions(audit=False))  # fake logprobs
    assert staged.marker.rows == config.num_rollouts
    status = batch_status(Batch.open(root, config.batch_id))
    assert status.shards[0].committed.failovers == (0,)
    assert "failed over from attempt(s) [0]" in render_status(status)


def test_status_reads_a_failover_from_two_claims_of_one_process() -> None:
    def claim(attempt: int, pid: int) -> AttemptClaim:
        return AttemptClaim("b", 0, attempt, "host", pid, 1.0 + attempt, None, "")

    assert failed_over([claim(0, 7), claim(1, 7), claim(2, 8), claim(3, 9)]) == (0,)
    assert failed_over([claim(1, 7), claim(0, 7)]) == (0,) and failed_over([claim(0, 7)]) == ()


def test_a_replica_lost_with_no_other_ends_the_attempt_for_the_retry(servers, tmp_path) -> None:
    only = servers[0]
    only.abort_calls, only.weight_version = range(3, 10**6), "default"
    engine = EngineSpec(name="vllm_server", options=options(only))
    config = bundled_model_config(batch_id="b-one", num_tasks=2, engine=engine)
    root = str(tmp_path / "runs")
    plan_batch(Batch.open(root, config.batch_id), config)
    with pytest.raises(ReplicaDeadError, match="aborted it"):
        generate_shard(Batch.open(root, config.batch_id), 0, progress=False)
    assert Batch.open(root, config.batch_id).shard_marker(0) is None
    only.abort_calls = ()
    summary = generate_shard(Batch.open(root, config.batch_id), 0, progress=False)
    assert summary.attempt == 1 and summary.failovers == () and summary.rollouts == config.num_rollouts
