"""The gateway on loopback, inside the running event loop: :func:`serving`.

One gateway per generate attempt: uvicorn serves :func:`tasks.gateway.app.create_app` on
``127.0.0.1`` at a port the kernel picks, as a task of the attempt's own event loop (the loop that
runs the rollouts), so a request reaches the capture path without crossing threads. The server
stops when the block ends; requests still in flight are cancelled with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from tasks.gateway.app import Rollouts, create_app
from tasks.gateway.limits import DEFAULT_LIMITS, GatewayLimits

START_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 10.0


@contextlib.asynccontextmanager
async def serving(rollouts: Rollouts, limits: GatewayLimits = DEFAULT_LIMITS) -> AsyncIterator[str]:
    """Serve ``rollouts`` under ``limits`` on loopback inside the block; yields the base URL (``http://127.0.0.1:PORT``)."""
    import uvicorn

    config = uvicorn.Config(
        create_app(rollouts, limits),
        host="127.0.0.1",
        port=0,
        log_level=logging.WARNING,
        lifespan="off",
        access_log=False,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(), name="capture-gateway")
    try:
        async with asyncio.timeout(START_TIMEOUT_SECONDS):
            while not server.started:
                if task.done():
                    task.result()  # the error that stopped it
                    raise RuntimeError("the capture gateway stopped while starting")
                await asyncio.sleep(0.01)
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT_SECONDS)
        if not done:
            task.cancel()
