"""The key guard of ``rollout-ledger serve`` (:class:`RequireKey`) around a fake upstream app, and the key helpers.

The fake records what reached it and answers in several chunks, so a test sees whether the guard
refuses, forwards method, path, query, headers and body unchanged, and lets a streamed answer
through chunk by chunk. The real server's routes are tested in ``test_serve_auth_server.py``.
"""

from __future__ import annotations

import asyncio
import importlib
import stat
import subprocess
import sys

import httpx
import pytest

from tasks.engines.vllm_server.serving.auth import RequireKey
from tasks.engines.vllm_server.serving.keys import (
    KEY_ENV,
    MIDDLEWARE_PATH,
    generated_key_path,
    is_loopback,
    write_new_key,
)
from tasks.engines.vllm_server.serving.launch import server_env
from tests.engines.fake_asgi import request_body

KEY = "the-right-key"


class FakeUpstream:
    """An ASGI app standing in for vLLM's: records each request and streams three chunks back."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.lifespans = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            self.lifespans += 1
            return
        body = await request_body(receive)
        self.seen.append(
            {
                "method": scope["method"],
                "path": scope["path"],
                "query": scope["query_string"],
                "headers": dict(scope["headers"]),
                "body": body,
            }
        )
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-upstream", b"yes")]})
        for chunk in (b"one ", b"two ", b"three"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture
def upstream(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeUpstream, RequireKey]:
    monkeypatch.setenv(KEY_ENV, KEY)
    fake = FakeUpstream()
    return fake, RequireKey(fake)


def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(send())


@pytest.mark.parametrize("path", ["/pause", "/collective_rpc", "/metrics", "/v1/models", "/health/", "/healthz", "/"])
@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong-key", f"Basic {KEY}", f"Bearer {KEY}x", KEY, "Bearer", f"Bearer  {KEY}"]
)
def test_a_request_without_the_key_is_refused_before_the_upstream(upstream, path, authorization) -> None:
    fake, guard = upstream
    headers = {} if authorization is None else {"Authorization": authorization}
    response = call(guard, "POST", path, headers=headers, json={"x": 1})
    assert response.status_code == 401 and response.json() == {"error": "Unauthorized"}
    assert response.headers["www-authenticate"] == "Bearer" and KEY not in response.text
    assert fake.seen == []


def test_health_answers_without_the_key(upstream) -> None:
    fake, guard = upstream
    assert call(guard, "GET", "/health").status_code == 200
    assert [seen["path"] for seen in fake.seen] == ["/health"]


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_key_holder_reaches_the_upstream_with_everything_forwarded_and_the_stream_intact(upstream, scheme) -> None:
    fake, guard = upstream

    async def stream() -> tuple[int, dict, list[bytes]]:
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            headers = {"Authorization": f"{scheme} {KEY}", "X-Trace": "t-1"}
            async with client.stream("POST", "/pause?mode=keep", headers=headers, content=b"raw body") as response:
                return response.status_code, dict(response.headers), [chunk async for chunk in response.aiter_raw()]

    status, headers, chunks = asyncio.run(stream())
    assert status == 200 and headers["x-upstream"] == "yes" and b"".join(chunks) == b"one two three"
    (seen,) = fake.seen
    assert (seen["method"], seen["path"], seen["query"], seen["body"]) == ("POST", "/pause", b"mode=keep", b"raw body")
    assert seen["headers"][b"x-trace"] == b"t-1" and seen["headers"][b"authorization"] == f"{scheme} {KEY}".encode()


def test_a_websocket_without_the_key_is_closed_and_lifespan_passes_through(upstream) -> None:
    fake, guard = upstream
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "websocket.connect"}

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": [], "root_path": ""}
    asyncio.run(guard(scope, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}] and fake.seen == []
    asyncio.run(guard({"type": "lifespan"}, receive, send))
    assert fake.lifespans == 1


def test_a_server_without_a_key_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=KEY_ENV):
        RequireKey(FakeUpstream())
    from tasks.engines.vllm.options import VllmOptions

    with pytest.raises(ValueError, match="needs an API key"):
        server_env(VllmOptions(), api_key="", on_cpu=False)


def test_the_server_environment_replaces_any_inherited_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.engines.vllm.options import VllmOptions

    monkeypatch.setenv(KEY_ENV, "inherited")
    env = server_env(VllmOptions(), api_key=KEY, on_cpu=False)
    assert env[KEY_ENV] == KEY and env["VLLM_SERVER_DEV_MODE"] == "1"


def test_a_new_key_file_is_mode_0600_in_a_0700_folder_and_each_call_makes_a_new_key(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ROLLOUT_LEDGER_HOME", str(tmp_path))
    path = generated_key_path(8123)
    assert path == tmp_path / "serve" / "port-8123.key"
    first = write_new_key(path)
    assert path.read_text() == first + "\n" and len(first) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    second = write_new_key(path)
    assert second != first and path.read_text().strip() == second
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        *[("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True)],
        *[("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("my-host", False), ("", False)],
    ],
)
def test_only_loopback_hosts_count_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_serve_on_a_non_loopback_host_without_a_key_file_is_refused_before_anything_starts(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tasks.cli.main import main

    monkeypatch.setenv("ROLLOUT_LEDGER_HOME", str(tmp_path))
    assert main(["serve", "--host", "0.0.0.0", "--port", "8123"]) == 2
    assert "--host 0.0.0.0 is not a loopback address: give --api-key-file" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no key made, no model resolved, no log


def test_the_middleware_path_serve_passes_names_the_guard_and_launching_imports_no_starlette():
    module, _, name = MIDDLEWARE_PATH.rpartition(".")  # as vLLM's --middleware reads it
    assert getattr(importlib.import_module(module), name) is RequireKey
    code = "import sys, tasks.engines.vllm_server.serving.launch; print('starlette' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
