"""FAKE vLLM servers for the server hook's Test button: the endpoints it reads, no model, no engine.

Each answers ``/health`` to anyone and ``/v1/models``, ``/server_info``, ``/weight_info`` and
``/is_paused`` only with its bearer key (as a ``rollout-ledger serve`` server guards every route
but ``/health``), shaped like vLLM's answers; a wrong key gets 401.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeServer(ThreadingHTTPServer):
    """One FAKE server on a loopback port, serving ``model`` under ``key``."""

    def __init__(self, *, key: str, model: str = "policy") -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.key, self.model = key, model
        self.asked: list[tuple[str, str | None]] = []  # (path, the Authorization header)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, path: str) -> Any:
        routes = {
            "/v1/models": {"object": "list", "data": [{"id": self.model, "root": "/models/p", "max_model_len": 512}]},
            "/server_info": {
                "vllm_config": {"instance_id": "fake-1", "model_config": {"logprobs_mode": "processed_logprobs"}}
            },
            "/weight_info": {"weight_version": "default"},
            "/is_paused": {"is_paused": False},
        }
        return routes.get(path)


class _Answer(BaseHTTPRequestHandler):
    server: FakeServer

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        authorization = self.headers.get("Authorization")
        self.server.asked.append((path, authorization))
        if path == "/health":
            self._send(200, None)
        elif authorization != f"Bearer {self.server.key}":
            self._send(401, {"error": "Unauthorized"})
        else:
            body = self.server.answer(path)
            self._send(404 if body is None else 200, body)

    def _send(self, status: int, body: Any) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        return None


@contextmanager
def fake_servers(*models: str, key: str) -> Iterator[list[FakeServer]]:
    """One FAKE server per model name, each serving in a thread until the block ends."""
    servers = [FakeServer(key=key, model=model) for model in models]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        yield servers
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
