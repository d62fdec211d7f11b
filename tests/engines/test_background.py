"""BackgroundLoop: one event loop in a daemon thread that sync callers share."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tasks.engines.background import BackgroundLoop


def test_run_returns_the_result_from_the_loop_thread() -> None:
    with BackgroundLoop() as loop:

        async def where() -> str:
            return threading.current_thread().name

        assert loop.run(where()) == "engine-loop"


def test_objects_bound_to_the_loop_survive_across_runs() -> None:
    with BackgroundLoop() as loop:
        queue: asyncio.Queue[int] = loop.run(_make_queue())
        loop.run(queue.put(7))
        assert loop.run(queue.get()) == 7


async def _make_queue() -> asyncio.Queue[int]:
    return asyncio.Queue()


def test_exceptions_propagate_to_the_caller() -> None:
    async def fail() -> None:
        raise KeyError("boom")

    with BackgroundLoop() as loop, pytest.raises(KeyError, match="boom"):
        loop.run(fail())


def test_timeout_cancels_the_coroutine() -> None:
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with BackgroundLoop() as loop:
        with pytest.raises(TimeoutError):
            loop.run(forever(), timeout=0.05)
        assert cancelled.wait(5)


def test_close_is_idempotent_and_run_after_close_is_refused() -> None:
    loop = BackgroundLoop()
    loop.close()
    loop.close()
    assert loop.closed
    with pytest.raises(RuntimeError, match="BackgroundLoop is closed"):
        loop.run(asyncio.sleep(0))


def test_run_from_the_loop_thread_is_refused_instead_of_deadlocking() -> None:
    with BackgroundLoop() as loop:

        async def nested() -> None:
            loop.run(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="called from its own loop thread"):
            loop.run(nested(), timeout=5)
