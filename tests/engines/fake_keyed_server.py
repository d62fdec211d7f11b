"""A FAKE keyed server: it answers ``/health`` and refuses every other route with one HTTP status (401 or 403), as
a server does to a wrong key. No inference happens; it only lets tests see what a client says when refused."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator


class _Refusing(http.server.BaseHTTPRequestHandler):
    status = 401

    def _answer(self) -> None:
        body = b"" if self.path == "/health" else b'{"error": "Unauthorized"}'
        self.send_response(200 if self.path == "/health" else self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:  # quiet
        return


@contextlib.contextmanager
def fake_keyed_server(status: int = 401) -> Iterator[str]:
    """The URL of a FAKE server on loopback that refuses every route but /health with ``status``."""
    handler = type("Refusing", (_Refusing,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
