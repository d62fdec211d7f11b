"""Kept sets as the vLLM engines read them (hand-written outputs and answers, no engine), and the plan's refusal."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tasks.engines import registry
from tasks.engines.sampling_masks import (
    FILTERED_FLOOR,
    SamplingMaskOverflowError,
    candidates_to_ask,
    kept_from_candidates,
    kept_from_engine_mask,
)
from tasks.engines.vllm.engine import to_generation_result
from tasks.engines.vllm.options import VllmOptions
from tasks.engines.vllm_server.engine import parse_generate_answer
from tasks.errors import ConfigError, EngineError
from tasks.sampling import SamplingSettings

INF = math.inf


@pytest.mark.parametrize(
    ("settings", "asked"),
    [
        ({}, 0),
        ({"temperature": 0.0, "top_p": 0.9}, 0),
        ({"top_p": 0.9}, 64),
        ({"top_k": 50}, 51),
        ({"top_k": 500, "top_p": 0.9}, 64),
    ],
)
def test_candidates_are_asked_only_for_truncation_and_one_past_top_k(settings: dict, asked: int) -> None:
    assert candidates_to_ask(SamplingSettings(**settings), 64) == asked


def test_the_finite_candidates_are_the_kept_set_when_some_were_filtered() -> None:
    positions = [[(7, -0.1), (3, -2.5), (9, -INF)], [(4, 0.0), (1, FILTERED_FLOOR), (2, -INF)]]
    kept = kept_from_candidates("c0", [7, 4], positions, asked=3)
    assert [s.tolist() for s in kept.sets()] == [[3, 7], [4]]


def test_a_position_whose_every_candidate_is_kept_overflows() -> None:
    with pytest.raises(SamplingMaskOverflowError, match="request c0: token 1 kept at least 2 ids"):
        kept_from_candidates("c0", [7, 4], [[(7, -0.1), (3, -INF)], [(4, -0.5), (5, -0.9)]], asked=2)


@pytest.mark.parametrize(
    ("token_ids", "positions", "match"),
    [
        ([7], [[(3, -0.1), (7, -INF)]], "not in its own kept set"),
        ([7, 8], [[(7, -0.1), (3, -INF)]], "1 candidate lists for 2 tokens"),
    ],
)
def test_candidates_that_do_not_fit_the_tokens_are_an_engine_error(token_ids, positions, match) -> None:
    with pytest.raises(EngineError, match=match):
        kept_from_candidates("c0", token_ids, positions, asked=2)


def test_vllms_own_mask_is_taken_as_it_is_and_checked() -> None:
    assert kept_from_engine_mask("c0", [5, 6], [[6, 5], [6]]).token_ids.tolist() == [5, 6, 6]
    with pytest.raises(EngineError, match="a sampling mask of 1 positions for 2 tokens"):
        kept_from_engine_mask("c0", [5, 6], [[5]])


def _vllm_output(logprobs: list[dict[int, float]], sampling_mask: list[list[int]] | None = None) -> Any:
    token_ids = [next(iter(entry)) for entry in logprobs]
    completion = SimpleNamespace(
        token_ids=token_ids,
        logprobs=[{t: SimpleNamespace(logprob=lp) for t, lp in entry.items()} for entry in logprobs],
        finish_reason="length",
        text="t",
        stop_reason=None,
        sampling_mask=None if sampling_mask is None else SimpleNamespace(token_ids=sampling_mask),
    )
    return SimpleNamespace(prompt_token_ids=[1, 2], outputs=[completion])


def test_the_in_process_engine_reads_kept_sets_only_for_a_truncated_call() -> None:
    output = _vllm_output([{5: -0.2, 9: -1.8, 2: -INF}, {6: 0.0, 1: -INF, 2: -INF}])
    assert to_generation_result("c0", output).kept is None
    kept = to_generation_result("c0", output, masks=True, asked=3).kept
    assert [s.tolist() for s in kept.sets()] == [[5, 9], [6]]
    own = to_generation_result("c0", _vllm_output([{5: -0.2}, {6: 0.0}], [[5, 9, 11], [6]]), masks=True).kept
    assert own.counts.tolist() == [3, 1]  # vLLM's own mask (return_sampling_mask) wins over the logprobs


def _server_answer(top: list[list[tuple[int, float]]] | None, sampling_mask: Any = None) -> dict:
    content = [
        {"token_id": t, "logprob": -0.5, "top_logprobs": [{"token_id": i, "logprob": lp} for i, lp in entry]}
        for t, entry in zip([5, 6], top or [[], []], strict=True)
    ]
    choice = {
        "index": 0,
        "finish_reason": "length",
        "token_ids": [5, 6],
        "weight_versions": [{"version": "0", "start": 0, "end": 2}],
        "logprobs": {"content": content},
    }
    if sampling_mask is not None:
        choice["sampling_mask"] = sampling_mask
    return {"request_id": "x", "prompt_token_ids": [1], "choices": [choice]}


class _Decoder:
    """A fake tokenizer: decodes to nothing."""

    def decode(self, ids, skip_special_tokens: bool) -> str:
        return ""


def test_the_server_engine_reads_floored_top_logprobs_or_the_servers_mask() -> None:
    top = [[(5, -0.1), (8, -2.0), (3, FILTERED_FLOOR)], [(6, -0.01), (1, FILTERED_FLOOR), (2, FILTERED_FLOOR)]]
    result = parse_generate_answer("c0", _server_answer(top), "http://s", _Decoder(), masks=True, asked=3)
    assert [s.tolist() for s in result.kept.sets()] == [[5, 8], [6]]
    own = parse_generate_answer("c0", _server_answer(None, [[5], [2, 6]]), "http://s", _Decoder(), masks=True)
    assert own.kept.counts.tolist() == [1, 2]
    absent = parse_generate_answer("c0", _server_answer(None), "http://s", _Decoder(), masks=True, asked=0)
    assert absent.kept is None  # the capture names it: sampling_mask_missing


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sampling_mask": [[5], "6"]}, "not a list of token id lists"),
        ({"top": [[(5, "x")], []]}, "without an int token id and a number"),
    ],
)
def test_a_malformed_mask_in_a_server_answer_is_named(change: dict, match: str) -> None:
    body = _server_answer(change.get("top", [[], []]), change.get("sampling_mask"))
    with pytest.raises(EngineError, match=match):
        parse_generate_answer("c0", body, "http://s", _Decoder(), masks=True, asked=3)


def test_the_candidates_are_vllms_max_logprobs_and_not_an_engine_kwarg() -> None:
    assert VllmOptions(sampling_mask_candidates=128).engine_args(Path("/m"), on_cpu=False)["max_logprobs"] == 128
    with pytest.raises(ValueError, match=r"engine_kwargs\.max_logprobs: fixed by the vLLM engine"):
        VllmOptions(engine_kwargs={"max_logprobs": 5})


def test_planning_accepts_truncation_on_megatron_which_records_masks_but_not_what_it_cannot_sample() -> None:
    registry.check_sampling_masks("megatron", SamplingSettings())
    registry.check_sampling_masks("vllm", SamplingSettings(top_p=0.9, top_k=50))
    registry.check_sampling_masks("megatron", SamplingSettings(top_k=50))
    registry.check_sampling_masks("megatron", SamplingSettings(top_p=0.9))
    with pytest.raises(ConfigError, match=r"engine megatron cannot sample .*cannot combine top_k 50 with top_p 0.9"):
        registry.check_sampling_masks("megatron", SamplingSettings(top_p=0.9, top_k=50))
