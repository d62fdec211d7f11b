"""Selecting the Megatron engine: options checked at plan time, clear errors where it cannot run, sampling terms.

These run where CI runs (Python 3.11, no GPU, no megatron-core): the refusals are the real ones.
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from tasks.config import EngineSpec
from tasks.engines import check_engine, create_engine
from tasks.engines.megatron.availability import MegatronUnavailableError, require_gpu, require_megatron
from tasks.engines.megatron.options import MegatronOptions
from tasks.engines.megatron.results import to_generation_result
from tasks.engines.megatron.sampling import MegatronSampling, megatron_sampling
from tasks.errors import ConfigError, EngineError
from tasks.sampling import SamplingSettings

needs_no_megatron_machine = pytest.mark.skipif(
    sys.version_info >= (3, 12), reason="checks the refusal on machines without the megatron extra (CI: 3.11)"
)


def test_megatron_is_a_known_engine_whose_options_are_checked_at_plan_time() -> None:
    check_engine("megatron", {"dtype": "float32", "max_requests": 64, "inference_kwargs": {"block_size_tokens": 64}})
    assert EngineSpec(name="megatron", options={"kv_cache_gb": 2}).name == "megatron"
    with pytest.raises(ConfigError, match=r"unknown megatron engine option\(s\) \['max_num_seqs'\]"):
        EngineSpec(name="megatron", options={"max_num_seqs": 8})
    with pytest.raises(ValueError, match="dtype must be one of"):
        check_engine("megatron", {"dtype": "float16"})
    with pytest.raises(ValueError, match=r"inference_kwargs.logprobs_mode: fixed by the megatron engine"):
        check_engine("megatron", {"inference_kwargs": {"logprobs_mode": "raw_logprobs"}})
    with pytest.raises(ValueError, match=r"max_requests must be an int >= 1"):
        MegatronOptions(max_requests=0)
    with pytest.raises(ValueError, match=r"kv_cache_gb must be a number > 0"):
        MegatronOptions(kv_cache_gb=float("nan"))


@needs_no_megatron_machine
def test_starting_it_without_the_extra_says_what_to_install() -> None:
    with pytest.raises(MegatronUnavailableError, match=r"needs Python >= 3.12 .* use engine 'vllm' here"):
        require_megatron()
    with pytest.raises(MegatronUnavailableError, match=r"needs Python >= 3.12"):
        asyncio.run(create_engine("megatron", model_path="/unused"))


def test_no_gpu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MegatronUnavailableError, match="needs a CUDA GPU and this machine has none"):
        require_gpu()


def test_sampling_settings_in_megatron_terms() -> None:
    assert megatron_sampling(SamplingSettings(temperature=0.0)) == MegatronSampling(1.0, 1, 0.0)
    assert megatron_sampling(SamplingSettings()) == MegatronSampling(1.0, 0, 0.0)
    assert megatron_sampling(SamplingSettings(temperature=0.7, top_p=0.9)) == MegatronSampling(0.7, 0, 0.9)
    assert megatron_sampling(SamplingSettings(top_k=5)) == MegatronSampling(1.0, 5, 0.0)
    with pytest.raises(EngineError, match="top_k 1 at a temperature is greedy decoding"):
        megatron_sampling(SamplingSettings(top_k=1))
    with pytest.raises(EngineError, match=r"cannot combine top_k 5 with top_p 0.9"):
        megatron_sampling(SamplingSettings(top_k=5, top_p=0.9))


def _fake_finished(tokens: list[int], logprobs: list[float], status: str = "COMPLETED") -> SimpleNamespace:
    """A fake of megatron's finished DynamicInferenceRequest (only the fields the conversion reads)."""
    return SimpleNamespace(
        status=SimpleNamespace(name=status),
        generated_tokens=tokens,
        generated_log_probs=logprobs,
        generated_text="hi",
        events=[SimpleNamespace(type=SimpleNamespace(name="ERROR_NONTRANSIENT"), payload="too long")],
    )


def test_finished_requests_convert_with_the_stop_token_and_float32_logprobs() -> None:
    stopped = to_generation_result("c-1", [5, 6], _fake_finished([7, 2], [-0.5, -0.25]), eos_token_id=2)
    assert (stopped.finish_reason, stopped.token_ids, stopped.prompt_token_ids) == ("stop", (7, 2), (5, 6))
    assert stopped.logprobs.dtype == np.float32
    cut = to_generation_result("c-2", [5], _fake_finished([7, 8], [-0.5, -0.25]), eos_token_id=2)
    assert cut.finish_reason == "length" and cut.text == "hi"
    with pytest.raises(EngineError, match="c-3: megatron ended it as FAILED: too long"):
        to_generation_result("c-3", [5], _fake_finished([], [], status="FAILED"), eos_token_id=2)
    with pytest.raises(EngineError, match="c-4: megatron returned 1 logprobs for 2 tokens"):
        to_generation_result("c-4", [5], _fake_finished([7, 8], [-0.5]), eos_token_id=2)
