"""A request's body read under the gateway's byte cap, and parsed in a worker thread when large.

:func:`read_body` never reads past :attr:`GatewayLimits.max_body_bytes`: a declared
``Content-Length`` over it is refused before the app reads a byte of the body, and a body without
one (chunked) is counted as it streams in and refused the moment it would pass the cap.

What happens to the unread rest differs, deliberately. A declared body's rest is discarded by the
server as it arrives (never buffered or parsed), so that the client reads its 413: closing the
connection on unread data resets it, and the client then sees a connection error instead, which
the ``openai`` client retries (measured). A chunked body has no end the server knows of, so its
refusal closes the connection (``Connection: close``): the stream is cut at the cap, and its
sender may see the reset rather than the 413 (the ``openai`` client always sends a ``Content-Length``).

:func:`parse_json` parses a body larger than :data:`INLINE_PARSE_BYTES` in a worker thread, not
in a callback of the event loop that drives the engine. Under CPython's GIL that does not let the
loop run meanwhile (``json.loads`` holds the GIL for the whole parse: measured, a 4 MiB body of
small objects stalls the loop some 35-50 ms either way, 4 MiB of long strings some 7 ms); it does
on a free-threaded build. What bounds the stall is the byte cap.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request

from tasks.gateway.limits import GatewayLimits
from tasks.gateway.protocol import GatewayError

# Bodies up to this size (a short conversation) are parsed on the loop: a thread hop costs more.
INLINE_PARSE_BYTES = 64 * 1024


def too_large(limits: GatewayLimits, *, close: bool) -> GatewayError:
    """The 413 ``request_too_large`` of a body over ``limits.max_body_bytes``; with ``close``, the connection ends."""
    return GatewayError(
        413,
        f"the request body is larger than the gateway's {limits.max_body_bytes} bytes",
        kind="invalid_request_error",
        code="request_too_large",
        headers={"Connection": "close"} if close else None,
    )


async def read_body(request: Request, limits: GatewayLimits) -> bytes:
    """``request``'s body, of at most ``limits.max_body_bytes`` bytes; else :func:`too_large`, read no further."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise too_large(limits, close=False)
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limits.max_body_bytes:
            raise too_large(limits, close=True)  # a chunked body: the server frames a declared one
        body += chunk
    return bytes(body)


async def parse_json(body: bytes) -> object:
    """``body`` parsed as JSON: inline up to :data:`INLINE_PARSE_BYTES`, in a worker thread above.

    Raises ValueError for a body that is not JSON, RecursionError for one nested past the parser's depth.
    """
    if len(body) <= INLINE_PARSE_BYTES:
        return json.loads(body)
    return await asyncio.to_thread(json.loads, body)
