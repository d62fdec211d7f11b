"""A test environment (guess_number) whose first generate attempt is stopped midway by SIGTERM, like a preemption.

After ``stop_after`` episodes have finished in this process it sends its own process SIGTERM,
once per batch: ``stop_file`` records that it did, so the retry runs to the end.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from tasks.environments.base import Message, Turn
from tasks.environments.guess_number import GuessNumber


class StopsOnce(GuessNumber):
    name: ClassVar[str] = "stops_once"

    def __init__(self, *, stop_file: str, stop_after: int = 2, lo: int = 1, hi: int = 10) -> None:
        super().__init__(lo=lo, hi=hi)
        self.stop_file, self.stop_after, self.finished = stop_file, stop_after, 0

    def options(self) -> dict[str, Any]:
        return {**super().options(), "stop_file": self.stop_file, "stop_after": self.stop_after}

    def step(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        return self._count(super().step(task, messages))

    def finish_unfinished(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        return self._count(super().finish_unfinished(task, messages))

    def _count(self, turn: Turn) -> Turn:
        if turn.done:
            self.finished += 1
            if self.finished >= self.stop_after and not Path(self.stop_file).exists():
                Path(self.stop_file).write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGTERM)
        return turn
