"""A real ``rollout-ledger serve`` started without a key file: only the holder of the key it made can steer it.

The test run's server (the ``vllm_server`` fixture, ``tests/conftest.py``) is started as a user
starts it, on loopback with no ``--api-key-file``, its cache (key file, log) in a temporary
``ROLLOUT_LEDGER_HOME``. Every route vLLM lists, the RL and dev endpoints and ``/metrics``
included, refuses a call without the key or with a wrong one; ``/health`` answers anyone; the key
holder lists the model, generates (streamed too), refits and runs engine ``vllm_server``. At the
end of the run SIGTERM must leave no process behind (the fixture asserts it).
"""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tasks.engines import create_engine
from tasks.engines.base import GenerationRequest
from tasks.engines.vllm_server.engine import GENERATE_PATH
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
from tasks.sampling import SamplingSettings
from tests.conftest import RunningServer

pytestmark = [pytest.mark.e2e]

# What review named as open before the guard: each must be among the routes checked.
STEERING_ROUTES = (
    "/pause",
    "/resume",
    "/collective_rpc",
    "/update_weight_version",
    "/update_weights",
    "/reset_prefix_cache",
    "/sleep",
    "/wake_up",
    "/weight_info",
    "/server_info",
    "/metrics",
)


def auth(server: RunningServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.key}"}


def routes(server: RunningServer) -> list[tuple[str, str]]:
    """(method, path) of every route the server's own OpenAPI lists, path parameters filled, and pages it serves."""
    spec = httpx.get(f"{server.url}/openapi.json", headers=auth(server)).raise_for_status().json()
    listed = [
        (method.upper(), path.replace("{", "").replace("}", ""))
        for path, methods in spec["paths"].items()
        for method in methods
    ]
    return [*listed, ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/metrics"), ("GET", "/no-such-route")]


def test_every_route_but_health_refuses_a_call_without_the_key_or_with_a_wrong_one(vllm_server: RunningServer) -> None:
    checked = routes(vllm_server)
    assert {path for _, path in checked} >= set(STEERING_ROUTES)
    refused = []
    with httpx.Client(base_url=vllm_server.url, timeout=30) as client:
        for method, path in checked:
            for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": vllm_server.key}):
                answer = client.request(method, path, headers=headers, json={} if method == "POST" else None)
                refused.append((method, path, answer.status_code))
        health = client.get("/health")
        paused = client.get("/is_paused", headers=auth(vllm_server)).json()
    assert [entry for entry in refused if entry[2] != 401] == [("GET", "/health", 200)] * 3
    assert health.status_code == 200 and paused == {"is_paused": False}  # nothing reached the engine


def test_the_key_holder_lists_the_model_and_generates_whole_and_streamed(vllm_server: RunningServer) -> None:
    with httpx.Client(base_url=vllm_server.url, headers=auth(vllm_server), timeout=120) as client:
        (model,) = client.get("/v1/models").raise_for_status().json()["data"]
        body = {"model": model["id"], "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "seed": 1}}
        answer = client.post(GENERATE_PATH, json=body | {"return_token_ids": True}).raise_for_status().json()
        assert len(answer["choices"][0]["token_ids"]) == 3
        stream = {"model": model["id"], "prompt": "Count: 1, 2,", "max_tokens": 4, "stream": True}
        with client.stream("POST", "/v1/completions", json=stream) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert all("choices" in json.loads(event.removeprefix("data: ")) for event in events[:-1])


def test_the_generated_key_file_is_mode_0600_and_the_key_is_in_no_output(vllm_server: RunningServer) -> None:
    key_file = Path(vllm_server.key_file)
    assert key_file.parent == vllm_server.home / "serve"  # the key serve made, in its cache
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(vllm_server.key) >= 40
    stderr = (vllm_server.home / "serve.stderr").read_text()
    assert str(key_file) in stderr
    log = Path(vllm_server.log).read_text(errors="replace")  # in the cache too: <home>/logs/serve/port-<port>.log
    assert "Available routes are" in log
    assert vllm_server.key not in stderr and vllm_server.key not in log


def test_refit_works_with_the_key_file_and_is_refused_without_it(vllm_server: RunningServer) -> None:
    folder = resolve_model_reference(BUNDLED_REFERENCE)  # what the server serves: the same weights, reloaded
    refit = [sys.executable, "-m", "tasks.cli", "refit", "--urls", vllm_server.url, "--folder", str(folder)]
    keyless = subprocess.run(refit, capture_output=True, text=True, timeout=300, check=False)
    assert keyless.returncode == 2 and "HTTP 401" in keyless.stderr, keyless.stderr
    with vllm_server.at_weight_version(0):  # the server is shared: named 0 again after the refit
        keyed = subprocess.run(
            [*refit, "--api-key-file", vllm_server.key_file], capture_output=True, text=True, timeout=300, check=False
        )
        assert keyed.returncode == 0, keyed.stderr
        version = httpx.get(f"{vllm_server.url}/weight_info", headers=auth(vllm_server)).raise_for_status().json()
    assert f"at weight version {version['weight_version']}" in keyed.stdout and version["weight_version"] == "1"


def test_engine_vllm_server_generates_with_the_key_file(vllm_server: RunningServer) -> None:
    async def one_call():
        options = {"urls": [vllm_server.url], "api_key_file": vllm_server.key_file}
        model = resolve_model_reference(BUNDLED_REFERENCE)
        engine = await create_engine("vllm_server", model_path=model, options=options)
        try:
            prompt = tuple(engine.tokenizer.encode("Say hello.", add_special_tokens=False))
            request = GenerationRequest("k0", prompt, SamplingSettings(max_tokens=4), seed=3, session_id="r0")
            return await engine.generate(request)
        finally:
            await engine.close()

    result = asyncio.run(one_call())
    assert 0 < len(result.token_ids) <= 4 and len(result.logprobs) == len(result.token_ids)
