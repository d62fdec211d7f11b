"""What engine ``vllm_server`` accepts from a ``/inference/v1/generate`` answer: hand-written answers, no server.

Each answer below is shaped like vLLM 0.32's ``GenerateTokensResponse``; anything the capture
cannot prove (no ids, no logprobs, logprobs of other tokens, no weight spans, spans that skip
tokens) is a named engine error, never a fallback to text; an ``abort`` finish is the replica's
death, never a reply. New rollouts spread over idle replicas.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tasks.engines.base import WeightVersionSpan
from tasks.engines.vllm_server.claims import check_claims, parse_weight_version
from tasks.engines.vllm_server.engine import VllmServerEngine, parse_generate_answer, tie_break
from tasks.engines.vllm_server.replica import ReplicaDeadError, ServerReplica
from tasks.engines.vllm_server.server_claim import ServerClaim
from tasks.errors import ConfigError, EngineDeadError, EngineError

URL = "http://127.0.0.1:8000"


class FakeTokenizer:
    """A fake tokenizer: each id decodes to ``<id>``."""

    def decode(self, ids, skip_special_tokens: bool) -> str:
        return "".join(f"<{i}>" for i in ids)


def answer(**choice_changes) -> dict:
    choice = {
        "index": 0,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": [5, 6, 7],
        "weight_versions": [{"version": "default", "start": 0, "end": 3}],
        "logprobs": {
            "content": [
                {"token_id": 5, "logprob": -0.5, "rank": 1},
                {"token_id": 6, "logprob": -1.25, "rank": 2},
                {"token_id": 7, "logprob": -4.229698181152344, "rank": 9},
            ]
        },
    }
    return {"request_id": "generate-tokens-c0", "prompt_token_ids": [1, 2], "choices": [choice | choice_changes]}


def test_a_full_answer_gives_ids_float32_logprobs_text_and_spans() -> None:
    result = parse_generate_answer("c0", answer(), URL, FakeTokenizer())
    assert result.prompt_token_ids == (1, 2) and result.token_ids == (5, 6, 7)
    assert result.logprobs.dtype == np.float32
    assert result.logprobs.tolist() == [-0.5, -1.25, float(np.float32(-4.229698181152344))]
    assert result.text == "<5><6><7>" and result.finish_reason == "length"
    assert result.weight_spans == (WeightVersionSpan(0, 0, 3),)
    assert result.metadata["server"] == URL


def test_a_refit_mid_call_gives_two_spans() -> None:
    spans = [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}]
    result = parse_generate_answer("c0", answer(weight_versions=spans), URL, FakeTokenizer())
    assert result.weight_spans == (WeightVersionSpan(2, 0, 1), WeightVersionSpan(3, 1, 3))


def _without_prompt_ids() -> dict:
    body = answer()
    del body["prompt_token_ids"]
    return body


def _logprob_of_another_token() -> dict:
    body = answer()
    body["choices"][0]["logprobs"]["content"][1]["token_id"] = 99
    return body


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (answer(token_ids=None), "without token ids"),
        (answer(token_ids=[5, "6", 7]), "without token ids"),
        (_without_prompt_ids(), "without the prompt's token ids"),
        (answer(logprobs=None), "answered 0 logprobs for 3 tokens"),
        (_logprob_of_another_token(), "logprob of another token at position 1"),
        (answer(finish_reason="tool_calls"), "finished with 'tool_calls'"),
        (answer(weight_versions=[{"version": "1", "start": 0, "end": 2}]), "do not cover its 3 tokens"),
        (answer(weight_versions=[{"version": "v7", "start": 0, "end": 3}]), "weight version 'v7'"),
        (answer(weight_versions=None), "answered 3 tokens without weight-version spans"),
        (answer(weight_versions=[]), "answered 3 tokens without weight-version spans"),
        (answer(token_ids=[], logprobs={"content": []}, weight_versions=[]), "answered 0 tokens without weight"),
        ({"choices": []}, "without exactly one choice"),
        ("not json object", "without exactly one choice"),
    ],
)
def test_an_answer_the_capture_cannot_prove_is_a_named_engine_error(body, message) -> None:
    with pytest.raises(EngineError, match=message) as error:
        parse_generate_answer("c0", copy.deepcopy(body), URL, FakeTokenizer())
    assert f"request c0: server {URL}" in str(error.value)


def test_an_abort_finish_is_the_replicas_death_never_a_completed_reply() -> None:
    for tokens in ([5, 6, 7], []):
        content = [{"token_id": t, "logprob": -0.5} for t in tokens]
        spans = [{"version": "0", "start": 0, "end": len(tokens)}] if tokens else []
        body = answer(finish_reason="abort", token_ids=tokens, logprobs={"content": content}, weight_versions=spans)
        with pytest.raises(ReplicaDeadError, match=f"server {URL} aborted it after {len(tokens)} tokens") as died:
            parse_generate_answer("c0", body, URL, FakeTokenizer())
        assert isinstance(died.value, EngineDeadError) and died.value.url == URL
    with pytest.raises(ReplicaDeadError, match="aborted it after 3 tokens"):  # cut short of its logprobs and spans
        parse_generate_answer("c0", answer(finish_reason="abort", logprobs=None, weight_versions=None), URL, None)


def test_a_positive_or_infinite_logprob_is_refused() -> None:
    for value in (0.5, float("-inf"), True):
        body = answer()
        body["choices"][0]["logprobs"]["content"][0]["logprob"] = value
        with pytest.raises(EngineError, match=r"logprob .* at position 0"):
            parse_generate_answer("c0", body, URL, FakeTokenizer())


def test_weight_versions_read_default_as_zero_and_refuse_other_names() -> None:
    assert parse_weight_version("default", URL) == 0 and parse_weight_version("12", URL) == 12
    for bad in ("-1", "07", "v2", None):
        with pytest.raises(EngineError):
            parse_weight_version(bad, URL)


def test_replicas_must_agree_and_return_processed_logprobs() -> None:
    one = ServerClaim("http://a:1", "m", "/models/m", 2048, 0, "processed_logprobs")
    assert check_claims([one, ServerClaim("http://b:1", "m", "/models/m", 2048, 0, "processed_logprobs")]) == one
    cases = [
        (ServerClaim("http://b:1", "m", "/models/n", 2048, 0, "processed_logprobs"), "replicas differ"),
        (ServerClaim("http://b:1", "m", "/models/m", 2048, 1, "processed_logprobs"), "different weight versions"),
        (ServerClaim("http://b:1", "m", "/models/m", 2048, 0, "raw_logprobs"), "--logprobs-mode processed_logprobs"),
    ]
    for other, message in cases:
        with pytest.raises(ConfigError, match=message):
            check_claims([one, other])


def _engine(urls: list[str]) -> VllmServerEngine:
    replicas = [ServerReplica(url, api_key=None, key_source="none", timeout_s=60) for url in urls]
    return VllmServerEngine(
        replicas, served_model="m", weights="verified", tokenizer=None, max_model_len=2048, weight_version=0
    )


def test_ties_between_idle_replicas_spread_rollouts_and_never_all_go_to_the_first() -> None:
    urls = ["http://a:1", "http://b:1", "http://c:1"]
    engine, other_process = _engine(urls), _engine(urls)
    first_picks = [engine._replica_for(f"rollout-{i}").url for i in range(30)]  # every replica idle: all ties
    assert set(first_picks) == set(urls)
    assert first_picks == [other_process._replica_for(f"rollout-{i}").url for i in range(30)]  # a stable hash
    without_session = [engine._replica_for(None).url for _ in range(3)]
    assert sorted(without_session) == urls  # in turn
    busy, idle = engine.replicas[0], engine.replicas[1:]
    busy.in_flight = 1
    assert {engine._replica_for(f"other-{i}").url for i in range(20)} == {r.url for r in idle}
    assert tie_break("rollout-7", 0) == tie_break("rollout-7", 99) and tie_break(None, 4) == 4


def test_a_rollout_stays_on_its_replica_until_that_one_is_lost() -> None:
    engine = _engine(["http://a:1", "http://b:1"])
    first = engine._replica_for("rollout-1")
    for replica in engine.replicas:
        replica.in_flight = 0 if replica is not first else 5
    assert engine._replica_for("rollout-1") is first  # pinned, however busy
    error = first.lose(ReplicaDeadError(first.url, f"server {first.url} is unreachable"))
    assert engine.survives(error)
    moved = engine._replica_for("rollout-1")
    assert moved is not first and engine._replica_for("rollout-1") is moved
    last = moved.lose(ReplicaDeadError(moved.url, f"server {moved.url} is unreachable"))
    assert not engine.survives(last)
    with pytest.raises(EngineDeadError, match="every server is lost"):
        engine._replica_for("rollout-2")
