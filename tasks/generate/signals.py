"""SIGTERM and SIGINT during generate: :class:`StopSignals`.

The first signal cancels the stage's main task, so the attempt flushes its receipts and shuts
the engine down; later signals only log. The handlers that were installed before come back on
exit, and the number of the signal that stopped the stage is kept for the error the caller gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM and SIGINT cancel the stage's main task once (later signals only log); previous handlers come back.

    Installed only on the main thread (where Python delivers signals); the signal number is kept
    so the caller can say which one stopped it.
    """

    def __init__(self) -> None:
        self.signum: int | None = None

    @contextlib.contextmanager
    def cancelling(self, task: asyncio.Task[Any] | None) -> Iterator[None]:
        if task is None or threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

        def stop(signum: int) -> None:
            if self.signum is not None:
                log.warning("%s received while stopping: still flushing and shutting down", signal.Signals(signum).name)
                return
            self.signum = signum
            log.warning("%s received: flushing completed rollouts and shutting down", signal.Signals(signum).name)
            task.cancel()

        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, stop, signum)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                loop.remove_signal_handler(signum)
                signal.signal(signum, handler)
