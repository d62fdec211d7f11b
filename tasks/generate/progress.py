"""Progress of a shard's rollouts as a person watches it: :class:`Progress`.

Display only: nothing here decides what is run, receipted or committed. A bar on a terminal,
log lines otherwise; either keeps moving while no rollout finishes.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

log = logging.getLogger(__name__)
HEARTBEAT_SECONDS = 10.0


class Progress:
    """Progress per model call: a bar on a terminal (rollouts, calls, tok/s, failures), log lines otherwise.

    :meth:`heartbeat` keeps both alive while nothing finishes: the bar's clock ticks every second
    and a log line is written at least every :data:`HEARTBEAT_SECONDS`.
    """

    def __init__(self, *, total: int, enabled: bool | None, label: str) -> None:
        self.total = total
        self.done = 0
        self.calls = 0
        self.failures = 0
        self.tokens = 0
        self.label = label
        self.started = time.monotonic()
        interactive = sys.stderr.isatty() if enabled is None else enabled
        self.bar = None
        if interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="rollout", dynamic_ncols=True, file=sys.stderr)

    def call_done(self, tokens: int, failed: bool) -> None:
        self.calls += 1
        self.tokens += tokens
        self.failures += int(failed)
        if self.bar is not None:
            self.bar.set_postfix(calls=self.calls, tok_s=f"{self._rate():.0f}", failures=self.failures, refresh=False)
            self.bar.refresh()

    def rollout_done(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(1.0 if self.bar is not None else HEARTBEAT_SECONDS)
            if self.bar is not None:
                self.bar.refresh()
            else:
                self.log()

    def log(self) -> None:
        log.info(
            "%s: %d/%d rollouts done, %d calls, %d tokens (%.0f tok/s), %d failure rows, %.0f s",
            self.label,
            self.done,
            self.total,
            self.calls,
            self.tokens,
            self._rate(),
            self.failures,
            time.monotonic() - self.started,
        )

    def _rate(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self.log()
