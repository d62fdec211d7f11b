"""The real vLLM engine on the bundled SmolLM2 model (CPU, fp32), shared by the whole test run.

Every test calls the one session engine through its BackgroundLoop; the refit test puts the
original weights back before it ends.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tasks.engines.base import GenerationRequest, GenerationResult
from tasks.errors import EngineError
from tasks.sampling import SamplingSettings

pytestmark = pytest.mark.e2e


def _prompt(engine: Any, question: str) -> tuple[int, ...]:
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def _request(
    request_id: str,
    prompt: tuple[int, ...],
    *,
    seed: int,
    temperature: float = 1.0,
    max_tokens: int = 16,
    top_p: float = 1.0,
    top_k: int = -1,
) -> GenerationRequest:
    sampling = SamplingSettings(temperature=temperature, max_tokens=max_tokens, top_p=top_p, top_k=top_k)
    return GenerationRequest(request_id, prompt, sampling, seed=seed)


def _generate_all(vllm_engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    engine, loop = vllm_engine

    async def together() -> list[GenerationResult]:
        return list(await asyncio.gather(*(engine.generate(r) for r in requests)))

    return loop.run(together(), timeout=300)


def test_generate_returns_the_prompt_ids_and_one_float32_logprob_per_token(vllm_engine) -> None:
    engine, _ = vllm_engine
    prompt = _prompt(engine, "What is 2+3?")
    (result,) = _generate_all(vllm_engine, [_request("shape-0", prompt, seed=1, max_tokens=12)])
    assert result.request_id == "shape-0"
    assert result.prompt_token_ids == prompt
    assert 1 <= len(result.token_ids) <= 12
    assert result.logprobs.dtype == np.float32
    assert result.logprobs.shape == (len(result.token_ids),)
    assert np.isfinite(result.logprobs).all() and (result.logprobs <= 0).all()
    assert result.text == engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_logprobs_are_the_processed_ones_the_token_was_sampled_from(vllm_engine) -> None:
    """At temperature 0.5 each logprob is log_softmax(logits / 0.5) of the HF model in fp32, not the raw one."""
    import torch
    from transformers import AutoModelForCausalLM

    engine, _ = vllm_engine
    temperature = 0.5
    prompt = _prompt(engine, "Name a colour.")
    (result,) = _generate_all(
        vllm_engine, [_request("processed-0", prompt, seed=3, temperature=temperature, max_tokens=10)]
    )
    model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32, local_files_only=True)
    ids = torch.tensor([prompt + result.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    sampled = torch.tensor(result.token_ids)[:, None]
    processed = torch.log_softmax(logits / temperature, dim=-1).gather(1, sampled)[:, 0].numpy()
    raw = torch.log_softmax(logits, dim=-1).gather(1, sampled)[:, 0].numpy()
    assert np.abs(result.logprobs - processed).max() < 1e-3
    assert np.abs(result.logprobs - raw).max() > 1e-2  # raw mode would have recorded something else


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.9, 0.9, 50), (0.6, 0.8, -1), (1.0, 1.0, 20)])
def test_a_truncated_call_keeps_exactly_the_ids_an_fp32_recompute_keeps(vllm_engine, temperature, top_p, top_k) -> None:
    """Each sampled token's kept set, read from the top logprobs, is the set of ids the processed fp32 HF
    distribution leaves finite; it holds the sampled token, and the sampled logprob is renormalized over it.
    (Top-p alone at temperature 1 keeps hundreds of ids at some tokens: more than the 64 candidates read.)"""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.finalize.logprob_audit import processed_log_softmax

    engine, _ = vllm_engine
    prompts = [_prompt(engine, question) for question in ("Tell me about the sea.", "Name three birds.")]
    requests = [
        _request(f"kept-{i}", prompt, seed=20 + i, temperature=temperature, max_tokens=24, top_p=top_p, top_k=top_k)
        for i, prompt in enumerate(prompts)
    ]
    results = _generate_all(vllm_engine, requests)
    model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32, local_files_only=True)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.kept is not None and len(result.kept) == len(result.token_ids)
        result.kept.check(result.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1 : -1]
        processed = processed_log_softmax(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        for position, kept in enumerate(result.kept.sets()):
            assert kept.tolist() == torch.isfinite(processed[position]).nonzero().flatten().tolist()
        sampled = processed.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0].numpy()
        assert np.abs(result.logprobs - sampled).max() < 1e-3


def test_a_kept_set_larger_than_the_candidates_read_fails_the_call_and_the_engine_serves_on(vllm_engine) -> None:
    from tasks.engines.sampling_masks import SamplingMaskOverflowError

    engine, loop = vllm_engine
    prompt = _prompt(engine, "Say anything.")
    with pytest.raises(SamplingMaskOverflowError, match="request wide-0: token 0 kept at least 64 ids"):
        loop.run(engine.generate(_request("wide-0", prompt, seed=0, temperature=2.0, top_p=0.999)), timeout=60)
    (plain,) = _generate_all(vllm_engine, [_request("wide-after", prompt, seed=0, max_tokens=2)])
    assert plain.kept is None and len(plain.token_ids) == 2


def test_same_seed_gives_the_same_tokens_and_logprobs_at_any_batch_size(vllm_engine) -> None:
    engine, _ = vllm_engine
    prompt = _prompt(engine, "Tell me a fact about cats.")
    (alone,) = _generate_all(vllm_engine, [_request("seed-alone", prompt, seed=11)])
    crowd = _generate_all(vllm_engine, [_request(f"seed-crowd-{i}", prompt, seed=11 + i) for i in range(8)])
    assert crowd[0].token_ids == alone.token_ids
    # fp32 batched kernels reduce in another order: tokens are identical, logprobs equal to ~1e-5
    np.testing.assert_allclose(crowd[0].logprobs, alone.logprobs, rtol=0, atol=1e-4)
    assert len({r.token_ids for r in crowd}) > 1  # different seeds do sample differently


def test_many_concurrent_requests_share_one_continuous_batch(vllm_engine) -> None:
    engine, loop = vllm_engine
    prompt = _prompt(engine, "Count to ten.")
    requests = [_request(f"batch-{i}", prompt, seed=i, max_tokens=16) for i in range(32)]
    seen: list[int] = []

    async def generate_and_watch() -> list[GenerationResult]:
        work = asyncio.gather(*(engine.generate(r) for r in requests))
        while not work.done():
            seen.append(engine.num_unfinished_requests)
            await asyncio.sleep(0.05)
        return list(await work)

    results = loop.run(generate_and_watch(), timeout=300)
    assert max(seen) == 32  # every request was inside the engine at once
    assert engine.num_unfinished_requests == 0
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    assert all(r.prompt_token_ids == prompt and len(r.logprobs) == len(r.token_ids) for r in results)


def test_finish_reason_is_length_at_max_tokens_and_stop_at_end_of_turn(vllm_engine) -> None:
    engine, _ = vllm_engine
    prompt = _prompt(engine, "What is 2+3? Answer with one number.")
    results = _generate_all(vllm_engine, [_request(f"finish-{i}", prompt, seed=i, max_tokens=24) for i in range(8)])
    stopped = [r for r in results if r.finish_reason == "stop"]
    cut = [r for r in results if r.finish_reason == "length"]
    assert stopped and all(r.token_ids[-1] == engine.eos_token_id for r in stopped)
    assert all(len(r.token_ids) == 24 and engine.eos_token_id not in r.token_ids for r in cut)
    (short,) = _generate_all(vllm_engine, [_request("finish-short", prompt, seed=0, max_tokens=2)])
    assert short.finish_reason == "length" and len(short.token_ids) == 2


def test_prompt_longer_than_max_model_len_raises_engine_error_and_engine_keeps_serving(vllm_engine) -> None:
    engine, loop = vllm_engine
    too_long = (1,) * (engine.max_model_len + 5)
    with pytest.raises(EngineError, match=r"request too-long-0: prompt of \d+ tokens leaves no room"):
        loop.run(engine.generate(_request("too-long-0", too_long, seed=0)), timeout=60)
    (after,) = _generate_all(vllm_engine, [_request("after-too-long", _prompt(engine, "Hi"), seed=0, max_tokens=2)])
    assert len(after.token_ids) == 2


def test_vllm_rejection_becomes_engine_error_naming_the_request(vllm_engine) -> None:
    engine, loop = vllm_engine
    out_of_vocab = (*_prompt(engine, "Hi"), 10**7)
    with pytest.raises(EngineError, match="request bad-token-0: vLLM failed"):
        loop.run(engine.generate(_request("bad-token-0", out_of_vocab, seed=0)), timeout=60)


def _perturbed_copy(source: Path, target: Path) -> Path:
    """A copy of the model folder with its final norm scaled: same tokenizer, different weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(source / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_refit_bumps_the_version_serves_new_weights_and_keeps_in_flight_requests(
    vllm_engine, tmp_path_factory: pytest.TempPathFactory
) -> None:
    engine, loop = vllm_engine
    original = engine.model_path
    changed = _perturbed_copy(original, tmp_path_factory.mktemp("refit") / "model")
    prompt = _prompt(engine, "Describe the sea.")
    probe = _request("refit-probe", prompt, seed=5, max_tokens=8)
    (before,) = _generate_all(vllm_engine, [probe])
    version = engine.weight_version

    async def refit_while_generating() -> tuple[GenerationResult, int]:
        in_flight = asyncio.create_task(engine.generate(_request("refit-in-flight", prompt, seed=5, max_tokens=48)))
        await asyncio.sleep(0.3)
        assert not in_flight.done(), "the request finished before the refit began"
        new_version = await engine.update_weights(str(changed))
        return await in_flight, new_version

    in_flight, new_version = loop.run(refit_while_generating(), timeout=300)
    assert new_version == version + 1 == engine.weight_version
    assert engine.model_path == changed
    assert in_flight.finish_reason in ("stop", "length") and len(in_flight.logprobs) == len(in_flight.token_ids)
    (on_changed,) = _generate_all(vllm_engine, [probe])
    assert np.abs(on_changed.logprobs - before.logprobs).max() > 1e-3 or on_changed.token_ids != before.token_ids

    assert loop.run(engine.update_weights(str(original)), timeout=300) == version + 2
    (restored,) = _generate_all(vllm_engine, [probe])
    assert restored.token_ids == before.token_ids
    np.testing.assert_array_equal(restored.logprobs, before.logprobs)


def test_refit_to_a_folder_with_another_tokenizer_is_refused(vllm_engine, tmp_path: Path) -> None:
    engine, loop = vllm_engine
    other = tmp_path / "other"
    shutil.copytree(engine.model_path, other, ignore=shutil.ignore_patterns("*.safetensors"))
    (other / "model.safetensors").symlink_to(engine.model_path / "model.safetensors")
    (other / "tokenizer_config.json").write_text('{"model_max_length": 7}')
    version = engine.weight_version
    with pytest.raises(EngineError, match="tokenizer differs from the served one"):
        loop.run(engine.update_weights(str(other)), timeout=60)
    assert engine.weight_version == version
