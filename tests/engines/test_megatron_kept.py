"""The Megatron engine's kept sets (issue 46): what its sampler kept, filed per request, checked, and planned for.

On CPU: :class:`tasks.engines.megatron.kept.KeptRecorder`, the result's kept sets
(:func:`tasks.engines.megatron.results.kept_sets`), megatron's sampling limits at plan time. Where
megatron-core imports (marker ``gpu``; bench/gpu_megatron.sh runs them on the GPU machine), the recording sampler
(:class:`tasks.engines.megatron.model.VllmConventionSampling`) over a fake context: the kept sets are
exactly the filter's mask, the logprobs renormalize over them, and with CUDA it draws the very tokens
megatron's own ``TorchSampling`` draws from the same generator state.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tasks.engines import registry
from tasks.engines.megatron.kept import KeptRecorder
from tasks.engines.megatron.results import kept_sets, to_generation_result
from tasks.engines.megatron.sampling import megatron_sampling, refusal
from tasks.errors import ConfigError, EngineError
from tasks.sampling import SamplingSettings


def test_the_recorder_files_each_step_s_kept_ids_under_the_expected_requests_in_sampling_order() -> None:
    kept = KeptRecorder()
    kept.expect(7)
    kept.expect(9)
    vocab = 10
    first = torch.zeros(2, vocab, dtype=torch.bool)
    first[0, [1, 4, 5]] = True
    first[1, [0]] = True
    kept.stage([7, 8], first)  # 8 is not expected: its row is dropped
    second = torch.zeros(1, vocab, dtype=torch.bool)
    second[0, [2, 9]] = True
    kept.stage([9], second)
    assert kept.staged
    kept.record()
    assert not kept.staged
    third = torch.zeros(2, vocab, dtype=torch.bool)
    third[0, [3]] = True
    third[1, [6, 7, 8]] = True
    kept.stage([9, 7], third)
    kept.record()
    sets_of_7 = kept.take(7)
    assert [s.tolist() for s in sets_of_7] == [[1, 4, 5], [6, 7, 8]]
    assert all(s.dtype == np.int32 for s in sets_of_7)
    assert [s.tolist() for s in kept.take(9)] == [[2, 9], [3]]
    assert kept.take(7) is None and kept.take(8) is None and len(kept) == 0
    kept.stage([7], third[:1])  # taken: nothing is filed for it any more
    kept.record()
    assert kept.take(7) is None


def test_the_recorder_refuses_masks_that_do_not_fit_their_rows() -> None:
    with pytest.raises(ValueError, match="for 2 rows"):
        KeptRecorder().stage([1, 2], torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="float"):
        KeptRecorder().stage([1], torch.ones(1, 5))


def _finished(tokens: list[int]) -> Any:
    return SimpleNamespace(
        status=SimpleNamespace(name="COMPLETED"),
        events=[],
        generated_tokens=tokens,
        generated_log_probs=[-0.5] * len(tokens),
        generated_text="",
    )


def test_a_truncated_result_carries_its_kept_sets_as_csr_and_an_untruncated_one_none() -> None:
    sets = [np.array([3, 5, 8], np.int32), np.array([2], np.int32)]
    result = to_generation_result("r-0", [1, 2], _finished([5, 2]), eos_token_id=2, kept=sets)
    assert result.kept is not None and result.finish_reason == "stop"
    assert result.kept.counts.tolist() == [3, 1] and result.kept.token_ids.tolist() == [3, 5, 8, 2]
    assert to_generation_result("r-1", [1], _finished([5]), eos_token_id=2).kept is None


def test_kept_sets_that_do_not_fit_the_sampled_tokens_fail_the_call() -> None:
    with pytest.raises(EngineError, match=r"request r-0: megatron's sampler recorded 1 kept sets for 2 tokens"):
        kept_sets("r-0", [5, 2], [np.array([5], np.int32)])
    with pytest.raises(EngineError, match=r"request r-0: its sampling mask is unusable: .*not in its own kept set"):
        kept_sets("r-0", [5], [np.array([3, 4], np.int32)])
    with pytest.raises(EngineError, match=r"recorded 0 kept sets for 1 tokens"):
        to_generation_result("r-2", [1], _finished([5]), eos_token_id=2, kept=[])


def test_planning_accepts_what_megatron_records_and_refuses_what_it_cannot_sample() -> None:
    for settings in (SamplingSettings(top_k=50), SamplingSettings(top_p=0.9), SamplingSettings(temperature=0.0)):
        registry.check_sampling_masks("megatron", settings)
        assert refusal(settings) is None
    both = SamplingSettings(top_p=0.9, top_k=50)
    with pytest.raises(ConfigError, match=r"engine megatron cannot sample .*cannot combine top_k 50 with top_p 0.9"):
        registry.check_sampling_masks("megatron", both)
    with pytest.raises(EngineError, match="cannot combine"):
        megatron_sampling(both)
    with pytest.raises(ConfigError, match=r"top_k 1 at a temperature is greedy"):
        registry.check_sampling_masks("megatron", SamplingSettings(top_k=1))
    registry.check_sampling_masks("vllm", both)


def test_planning_still_refuses_truncation_on_an_engine_that_records_no_masks(monkeypatch) -> None:
    from dataclasses import replace

    engines = dict(registry.ENGINES)
    engines["megatron"] = replace(engines["megatron"], sampling_masks=False)
    monkeypatch.setattr(registry, "ENGINES", engines)
    registry.check_sampling_masks("megatron", SamplingSettings())
    with pytest.raises(ConfigError, match=r"engine megatron cannot record sampling masks.*use an engine .*vllm"):
        registry.check_sampling_masks("megatron", SamplingSettings(top_k=50))


# ---- the recording sampler, where megatron-core imports ------------------------------------------------


def needs_megatron(test: Any) -> Any:
    """A GPU-machine test (marker ``gpu``: the only tests that may skip in CI): it needs megatron-core."""
    reason = "needs megatron-core (the megatron extra, Python >= 3.12); run bench/gpu_megatron.sh on a GPU machine"
    return pytest.mark.gpu(pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason=reason)(test))


VOCAB = 300
# (temperature, top_k, top_p) per row, megatron's terms: greedy (top-k 1), top-k, top-p, untruncated.
ROWS = [(1.0, 1, 0.0), (0.7, 20, 0.0), (1.0, 0, 0.9), (0.7, 20, 0.0), (1.3, 0, 0.0), (1.0, 0, 0.9), (0.9, 0, 0.5)]


def _context(rows: list[tuple[float, int, float]], paused: int = 2) -> Any:
    total = paused + len(rows)
    return SimpleNamespace(
        total_request_count=total,
        paused_request_count=paused,
        request_ids=torch.arange(100, 100 + total, dtype=torch.int32),
        active_request_metadata={
            "temperature": torch.tensor([r[0] for r in rows], dtype=torch.float32),
            "top_k": torch.tensor([r[1] for r in rows], dtype=torch.int32),
            "top_p": torch.tensor([r[2] for r in rows], dtype=torch.float32),
        },
    )


def _sampler(seed: int, device: str) -> Any:
    from tasks.engines.megatron.model import VllmConventionSampling

    return VllmConventionSampling(torch.Generator(device=device).manual_seed(seed), VOCAB)


def _logits(device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return (torch.randn(len(ROWS), VOCAB, generator=generator) * 3).to(device=device, dtype=dtype)


@needs_megatron
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampler_records_the_filter_s_mask_and_renormalizes_logprobs_over_it(dtype: torch.dtype) -> None:
    from megatron.core.inference.sampling import TorchSampling

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sampler, context, logits = _sampler(0, device), _context(ROWS), _logits(device, dtype)
    request_ids = list(range(102, 102 + len(ROWS)))
    for row, (_, top_k, top_p) in zip(request_ids, ROWS, strict=True):
        if top_k > 1 or top_p > 0.0:
            sampler.kept.expect(row)
    tokens = sampler.sample_kernel(logits, len(ROWS), context, no_top_k=False, no_top_p=False)
    log_probs = sampler.log_probs_kernel(logits.float(), context)
    assert not sampler.kept.staged
    for row, (request_id, (temperature, top_k, top_p)) in enumerate(zip(request_ids, ROWS, strict=True)):
        token = int(tokens[row])
        sets = sampler.kept.take(request_id)
        if top_k == 1:
            assert sets is None and token == int(logits[row].argmax())
            expected = torch.log_softmax(logits[row].float(), dim=-1)
            torch.testing.assert_close(log_probs[row], expected)
            continue
        if top_k == 0 and top_p == 0.0:
            assert sets is None
            torch.testing.assert_close(log_probs[row], torch.log_softmax(logits[row].float() / temperature, dim=-1))
            continue
        (kept,) = sets
        filtered = TorchSampling.filter_logits(logits[row : row + 1], temperature, top_k, top_p, vocab_size=VOCAB)
        assert kept.tolist() == torch.nonzero(filtered[0] != float("-inf"))[:, 0].tolist()
        assert token in kept.tolist()
        if top_k:
            assert len(kept) >= top_k  # ties at the k-th value are kept too
        scaled = logits[row].float() / temperature
        mass = torch.logsumexp(scaled[torch.as_tensor(kept, device=device).long()], dim=0)
        expected = scaled - mass
        dropped = torch.ones(VOCAB, dtype=torch.bool, device=device)
        dropped[torch.as_tensor(kept, device=device).long()] = False
        assert torch.isneginf(log_probs[row][dropped]).all()
        torch.testing.assert_close(log_probs[row][~dropped], expected[~dropped])


@needs_megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron's own sample_kernel runs on CUDA")
def test_the_recording_sampler_draws_what_megatron_s_own_sampler_draws() -> None:
    from megatron.core.inference.sampling import TorchSampling

    logits = _logits("cuda", torch.bfloat16)
    for seed in range(5):
        ours = _sampler(seed, "cuda").sample_kernel(logits, len(ROWS), _context(ROWS), no_top_k=False, no_top_p=False)
        own = TorchSampling(torch.Generator(device="cuda").manual_seed(seed), VOCAB).sample_kernel(
            logits, len(ROWS), _context(ROWS), no_top_k=False, no_top_p=False
        )
        assert ours.tolist() == own.tolist()
