"""A private asyncio event loop in a daemon thread, for driving an async engine from sync code.

An async engine (vLLM's ``AsyncLLM``) binds its output handler to the loop it was created
on, so every call into it must run on that same loop. Sync callers (tests, the CLI) that
each would otherwise spin up their own loop share one :class:`BackgroundLoop` instead:
create the engine with ``loop.run(...)`` and make every later call through it too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """An event loop running forever in its own daemon thread until :meth:`close`."""

    def __init__(self, name: str = "engine-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the background loop and return its result (or raise its exception).

        On ``timeout`` the coroutine is cancelled and :class:`TimeoutError` is raised. Must
        not be called from the loop's own thread (it would wait on itself forever).
        """
        if self.closed:
            coro.close()
            raise RuntimeError("BackgroundLoop is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("BackgroundLoop.run called from its own loop thread; await the coroutine instead")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    @property
    def closed(self) -> bool:
        return self._loop.is_closed() or not self._thread.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what is still pending, stop the loop and join its thread. Idempotent."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> BackgroundLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
