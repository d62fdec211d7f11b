"""Progress of a shard's rollouts as a person watches it: :class:`Progress`.

Display only: nothing here decides what is run, receipted or committed. A bar on a terminal,
log lines otherwise; either keeps moving while no rollout finishes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import time
from collections.abc import Mapping

from tasks.errors import ConfigError

log = logging.getLogger(__name__)
# Seconds between the log lines of a shard's progress when no bar is shown (an operator's setting).
HEARTBEAT_VARIABLE = "ROLLOUT_LEDGER_PROGRESS_SECONDS"
DEFAULT_HEARTBEAT_SECONDS = 10.0
MAX_HEARTBEAT_SECONDS = 3600.0


def heartbeat_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """``$ROLLOUT_LEDGER_PROGRESS_SECONDS`` (a number in (0, 3600]), else 10; any other value is a ConfigError."""
    text = environ.get(HEARTBEAT_VARIABLE)
    if text is None:
        return DEFAULT_HEARTBEAT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_HEARTBEAT_SECONDS:  # NaN fails too
        raise ConfigError(f"${HEARTBEAT_VARIABLE} must be seconds in (0, {MAX_HEARTBEAT_SECONDS:.0f}], got {text!r}")
    return seconds


class Progress:
    """Progress per model call: a bar on a terminal (rollouts, calls, tok/s, failures), log lines otherwise.

    :meth:`heartbeat` keeps both alive while nothing finishes: the bar's clock ticks every second
    and a log line is written every ``every_s`` seconds (:func:`heartbeat_seconds`).
    """

    def __init__(self, *, total: int, enabled: bool | None, label: str, every_s: float) -> None:
        self.every_s = every_s
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
            await asyncio.sleep(1.0 if self.bar is not None else self.every_s)
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
