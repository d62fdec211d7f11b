"""Crash points: named places where a crash trial kills this process with SIGKILL, as a lost node would.

The reliability trials (``tests/reliability/test_crash_trials.py``, ``bench/crash_trials.py``) set
``ROLLOUT_LEDGER_CRASH_AT`` to a JSON object::

    {"point": "object_write", "match": "*/staging/*", "hit": 3, "once": "/tmp/trial-7.crashed"}

and the ``hit``-th time this process reaches ``point`` with a detail matching the glob ``match``
(default ``*``) it creates the file ``once`` (optional) and sends itself SIGKILL: no cleanup, no
flush, no ``finally``. While ``once`` exists the crash point is disarmed, so the retry that an
orchestrator starts with the same environment runs through. Unset, as in production, a crash
point costs one attribute lookup.

Points (each at the boundary the architecture's recovery rules are about):

* ``engine_output`` (detail: call id): the engine returned a completion, nothing of it staged;
* ``object_write`` (detail: object path): inside a create-once write, bytes written, the
  object not yet created (local: temp file filled, not linked; S3: before the PUT completes);
* ``segment_written`` (detail: segment path): a staging segment exists, its ledger records do not.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

CRASH_AT_VARIABLE = "ROLLOUT_LEDGER_CRASH_AT"
POINTS = ("engine_output", "object_write", "segment_written")


@dataclass(frozen=True)
class CrashPoint:
    """Where a trial crashes: the ``hit``-th pass through ``point`` whose detail matches ``match``."""

    point: str
    hit: int = 1
    match: str = "*"
    once: str | None = None

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"${CRASH_AT_VARIABLE}: point must be one of {POINTS}, got {self.point!r}")
        if not isinstance(self.hit, int) or isinstance(self.hit, bool) or self.hit < 1:
            raise ValueError(f"${CRASH_AT_VARIABLE}: hit must be an integer >= 1, got {self.hit!r}")
        if not isinstance(self.match, str) or not self.match:
            raise ValueError(f"${CRASH_AT_VARIABLE}: match must be a non-empty glob, got {self.match!r}")
        if self.once is not None and (not isinstance(self.once, str) or not self.once):
            raise ValueError(f"${CRASH_AT_VARIABLE}: once must be a file path, got {self.once!r}")

    def to_json(self) -> str:
        return json.dumps({"point": self.point, "hit": self.hit, "match": self.match, "once": self.once})

    @classmethod
    def from_json(cls, text: str) -> CrashPoint:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"${CRASH_AT_VARIABLE} is not JSON: {exc}") from None
        if not isinstance(fields, dict) or set(fields) - {"point", "hit", "match", "once"}:
            raise ValueError(f"${CRASH_AT_VARIABLE} must be an object with keys point, hit, match, once: {text!r}")
        return cls(**fields)


class _Armed:
    """The crash point this process was started with, and how often it has been passed."""

    def __init__(self, crash: CrashPoint) -> None:
        self.crash, self.passed, self.lock = crash, 0, threading.Lock()

    def reached(self, point: str, detail: str) -> None:
        crash = self.crash
        if point != crash.point or not fnmatch.fnmatchcase(detail, crash.match):
            return
        with self.lock:
            self.passed += 1
            if self.passed != crash.hit or (crash.once is not None and Path(crash.once).exists()):
                return
            if crash.once is not None:
                Path(crash.once).write_text(f"{point} {detail} pid {os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)


def _armed_from_environment() -> _Armed | None:
    text = os.environ.get(CRASH_AT_VARIABLE)
    return _Armed(CrashPoint.from_json(text)) if text else None


_ARMED = _armed_from_environment()


def crash_point(point: str, detail: str) -> None:
    """Pass crash point ``point`` (one of :data:`POINTS`); SIGKILL here if this is the armed hit."""
    if _ARMED is not None:
        _ARMED.reached(point, detail)
