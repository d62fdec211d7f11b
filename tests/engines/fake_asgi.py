"""Pieces of the fake ASGI upstreams the server-guard tests put behind ``RequireKey``."""

from __future__ import annotations

from starlette.types import Receive


async def request_body(receive: Receive) -> bytes:
    """The whole body of the request ``receive`` delivers."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body
