"""A real ``rollout-ledger serve`` started without a key file: only the holder of the key it made can steer it.

One server for the module (30-80 s to start on CPU), started as a user starts it, on loopback with
no ``--api-key-file``, its cache (key file, log) in a temporary ``ROLLOUT_LEDGER_HOME``. Every route
vLLM lists, the RL and dev endpoints and ``/metrics`` included, refuses a call without the key or
with a wrong one; ``/health`` answers anyone; the key holder lists the model, generates (streamed
too), refits and runs engine ``vllm_server``. At the end SIGTERM must leave no process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tasks.engines import create_engine
from tasks.engines.base import GenerationRequest
from tasks.engines.vllm_server.engine import GENERATE_PATH
from tasks.engines.vllm_server.serving.launch import free_port
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
from tasks.sampling import SamplingSettings
from tests.serving import serve_process

# The same worker as the test run's shared server (conftest.py): the vLLM servers' tests run on one worker.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm_keyed_server")]  # its module server: one worker

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


@dataclass(frozen=True)
class KeyedServer:
    url: str
    folder: Path
    key_file: Path
    home: Path

    @property
    def key(self) -> str:
        return self.key_file.read_text().strip()

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedServer]:
    folder = resolve_model_reference(BUNDLED_REFERENCE)  # in the user's cache: the server's home has no model
    home = tmp_path_factory.mktemp("keyed-serve")
    port = free_port()
    argv = [sys.executable, "-m", "tasks.cli", "serve", "--port", str(port), "--model", str(folder)]
    argv += ["--engine-option", "max_model_len=2048"]
    env = dict(os.environ, ROLLOUT_LEDGER_HOME=str(home))
    with serve_process(argv, home, env) as url:
        assert url == f"http://127.0.0.1:{port}"
        yield KeyedServer(url, folder, home / "serve" / f"port-{port}.key", home)


def routes(server: KeyedServer) -> list[tuple[str, str]]:
    """(method, path) of every route the server's own OpenAPI lists, path parameters filled, and pages it serves."""
    spec = httpx.get(f"{server.url}/openapi.json", headers=server.auth()).raise_for_status().json()
    listed = [
        (method.upper(), path.replace("{", "").replace("}", ""))
        for path, methods in spec["paths"].items()
        for method in methods
    ]
    return [*listed, ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/metrics"), ("GET", "/no-such-route")]


def test_every_route_but_health_refuses_a_call_without_the_key_or_with_a_wrong_one(server: KeyedServer) -> None:
    checked = routes(server)
    assert {path for _, path in checked} >= set(STEERING_ROUTES)
    refused = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for method, path in checked:
            for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": server.key}):
                answer = client.request(method, path, headers=headers, json={} if method == "POST" else None)
                refused.append((method, path, answer.status_code))
        health = client.get("/health")
        paused = client.get("/is_paused", headers=server.auth()).json()
    assert [entry for entry in refused if entry[2] != 401] == [("GET", "/health", 200)] * 3
    assert health.status_code == 200 and paused == {"is_paused": False}  # nothing reached the engine


def test_the_key_holder_lists_the_model_and_generates_whole_and_streamed(server: KeyedServer) -> None:
    with httpx.Client(base_url=server.url, headers=server.auth(), timeout=120) as client:
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


def test_the_generated_key_file_is_mode_0600_and_the_key_is_in_no_output(server: KeyedServer) -> None:
    assert stat.S_IMODE(server.key_file.stat().st_mode) == 0o600 and len(server.key) >= 40
    stderr = (server.home / "serve.stderr").read_text()
    assert str(server.key_file) in stderr
    log = next((server.home / "logs" / "serve").glob("port-*.log")).read_text(errors="replace")
    assert server.key not in stderr and server.key not in log


def test_refit_works_with_the_key_file_and_is_refused_without_it(server: KeyedServer) -> None:
    refit = [sys.executable, "-m", "tasks.cli", "refit", "--urls", server.url, "--folder", str(server.folder)]
    keyless = subprocess.run(refit, capture_output=True, text=True, timeout=300, check=False)
    assert keyless.returncode == 2 and "HTTP 401" in keyless.stderr, keyless.stderr
    keyed = subprocess.run(
        [*refit, "--api-key-file", str(server.key_file)], capture_output=True, text=True, timeout=300, check=False
    )
    assert keyed.returncode == 0, keyed.stderr
    version = httpx.get(f"{server.url}/weight_info", headers=server.auth()).raise_for_status().json()
    assert f"at weight version {version['weight_version']}" in keyed.stdout and version["weight_version"] != "default"


def test_engine_vllm_server_generates_with_the_key_file(server: KeyedServer) -> None:
    async def one_call():
        options = {"urls": [server.url], "api_key_file": str(server.key_file)}
        engine = await create_engine("vllm_server", model_path=server.folder, options=options)
        try:
            prompt = tuple(engine.tokenizer.encode("Say hello.", add_special_tokens=False))
            request = GenerationRequest("k0", prompt, SamplingSettings(max_tokens=4), seed=3, session_id="r0")
            return await engine.generate(request)
        finally:
            await engine.close()

    result = asyncio.run(one_call())
    assert 0 < len(result.token_ids) <= 4 and len(result.logprobs) == len(result.token_ids)
