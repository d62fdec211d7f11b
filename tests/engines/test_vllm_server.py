"""Engine ``vllm_server`` against the test run's real vLLM server (``vllm_server`` fixture), and the in-process engine.

Same prompts and seeds give the same token ids, logprobs and text on both; what the server
claims is checked before any call (model, key, weight version); a refit between calls is
recorded in the answers' weight spans.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from tasks.engines import create_engine
from tasks.engines.base import GenerationRequest
from tasks.engines.vllm_server.replica import ServerAuthError
from tasks.errors import EngineDeadError, ModelMismatchError
from tasks.models.provenance import WEIGHTS_DECLARED, WEIGHTS_VERIFIED
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
from tasks.sampling import SamplingSettings

pytestmark = pytest.mark.e2e


def _requests(tokenizer, count: int, *, temperature: float = 1.0) -> list[GenerationRequest]:
    requests = []
    for index in range(count):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Count to {index + 2}."}], tokenize=False, add_generation_prompt=True
        )
        prompt = tuple(tokenizer.encode(text, add_special_tokens=False))
        truncated = {"top_p": 0.9, "top_k": 50} if index % 2 else {}
        sampling = SamplingSettings(temperature=temperature, max_tokens=12, **truncated)
        requests.append(GenerationRequest(f"c{index}", prompt, sampling, seed=100 + index, session_id=f"r{index}"))
    return requests


async def _server_engine(options: dict, model: Path | None = None):
    return await create_engine(
        "vllm_server", model_path=model or resolve_model_reference(BUNDLED_REFERENCE), options=options
    )


def test_the_server_samples_exactly_what_the_in_process_engine_samples_and_keeps_the_same_sets(
    vllm_server, vllm_engine
) -> None:
    local, loop = vllm_engine
    requests = _requests(local.tokenizer, 6, temperature=0.8)

    async def on_server():
        engine = await _server_engine(vllm_server.engine_options())
        try:
            assert engine.weights == WEIGHTS_VERIFIED and engine.max_model_len == local.max_model_len
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            await engine.close()

    async def in_process_engine():
        return await asyncio.gather(*(local.generate(r) for r in requests))

    served = asyncio.run(on_server())
    in_process = loop.run(in_process_engine(), timeout=300)
    for index, (remote, here) in enumerate(zip(served, in_process, strict=True)):
        assert remote.prompt_token_ids == here.prompt_token_ids
        assert remote.token_ids == here.token_ids
        assert remote.logprobs.dtype == np.float32 and np.array_equal(remote.logprobs, here.logprobs)
        assert remote.text == here.text and remote.finish_reason == here.finish_reason
        assert [(s.start, s.end) for s in remote.weight_spans] == [(0, len(remote.token_ids))]
        # top-p / top-k calls: the same kept sets, read from the server's top logprobs (-inf floored to -9999)
        assert (remote.kept is not None) == (here.kept is not None) == bool(index % 2)
        if here.kept is not None:
            assert remote.kept.digest() == here.kept.digest() and len(here.kept) == len(here.token_ids)


def test_a_wrong_api_key_is_refused_naming_where_the_key_came_from_never_the_key(vllm_server, tmp_path) -> None:
    wrong = tmp_path / "wrong-key"
    wrong.write_text("not-the-key-0123")
    with pytest.raises(ServerAuthError) as refused:
        asyncio.run(_server_engine(vllm_server.engine_options(api_key_file=str(wrong))))
    assert str(wrong) in str(refused.value) and "not-the-key-0123" not in str(refused.value)
    assert vllm_server.key not in str(refused.value)


def test_a_server_serving_another_model_is_refused_before_any_call(vllm_server, tmp_path) -> None:
    """The planned model here differs from the served one in its chat template only: still another model."""
    served = resolve_model_reference(BUNDLED_REFERENCE)
    planned = tmp_path / "other-model"
    shutil.copytree(served, planned)
    template = planned / "chat_template.jinja"
    if template.is_file():
        template.write_text(template.read_text() + "\n")
    else:
        config = planned / "tokenizer_config.json"
        config.write_text(config.read_text().replace('"chat_template": "', '"chat_template": " ', 1))
    with pytest.raises(ModelMismatchError, match="chat_template_sha256"):
        asyncio.run(_server_engine(vllm_server.engine_options(), planned))


def test_weights_the_worker_cannot_hash_are_accepted_only_by_name_as_declared(vllm_server, tmp_path) -> None:
    """A server whose folder is not on this machine: refused unless served_model names what it serves."""
    from tasks.engines.vllm_server.server_claim import ServerClaim
    from tasks.engines.vllm_server.weights import check_served_weights

    planned = resolve_model_reference(BUNDLED_REFERENCE)
    remote = ServerClaim(vllm_server.url, "smollm2", "/elsewhere/smollm2", 2048, 0, "processed_logprobs")
    with pytest.raises(ModelMismatchError, match="served_model='smollm2'"):
        check_served_weights(remote, planned, None)
    with pytest.raises(ModelMismatchError, match="not the declared"):
        check_served_weights(remote, planned, "llama")
    assert check_served_weights(remote, planned, "smollm2") == WEIGHTS_DECLARED


def test_a_refit_between_calls_is_recorded_in_the_weight_spans(vllm_server) -> None:
    folder = str(resolve_model_reference(BUNDLED_REFERENCE))

    async def refit_between_calls():
        engine = await _server_engine(vllm_server.engine_options())
        try:
            before_version = engine.weight_version
            (request,) = _requests(engine.tokenizer, 1)
            before = await engine.generate(request)
            version = await engine.update_weights(folder)
            after = await engine.generate(request)
            return before_version, before, version, after
        finally:
            await engine.close()

    before_version, before, version, after = asyncio.run(refit_between_calls())
    try:
        assert version == before_version + 1
        assert {span.version for span in before.weight_spans} == {before_version}
        assert {span.version for span in after.weight_spans} == {version}
        assert after.token_ids == before.token_ids  # the same weights, reloaded: the same seeded sample
    finally:  # the server is shared: give it back the version the other tests plan with
        vllm_server.name_weight_version(0)


def test_an_unreachable_server_is_an_engine_death_not_a_failed_call(vllm_server) -> None:
    async def call_after_the_server_went_away():
        engine = await _server_engine(vllm_server.engine_options())
        try:
            engine.replicas[0]._client._base_url = httpx.URL("http://127.0.0.1:9")  # nothing listens on port 9
            (request,) = _requests(engine.tokenizer, 1)
            await engine.generate(request)
        finally:
            await engine.close()

    with pytest.raises(EngineDeadError, match="unreachable"):
        asyncio.run(call_after_the_server_went_away())


def test_generate_refuses_a_server_older_than_the_planned_weight_version(vllm_server, tmp_path) -> None:
    from tasks.batch import Batch
    from tasks.config import EngineSpec
    from tasks.errors import ConfigError
    from tasks.generate import generate_shard
    from tasks.plan import plan_batch
    from tests.generation.configs import bundled_model_config

    engine = EngineSpec(name="vllm_server", options=vllm_server.engine_options())
    config = bundled_model_config(batch_id="b-ahead", weight_version=2, engine=engine)
    plan_batch(Batch.open(str(tmp_path), config.batch_id), config)
    with pytest.raises(ConfigError, match="serves weight version 0, older than the planned 2"):
        generate_shard(Batch.open(str(tmp_path), config.batch_id), 0, progress=False)
    assert Batch.open(str(tmp_path), config.batch_id).shard_marker(0) is None
