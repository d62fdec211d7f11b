"""The demo's console: one line per task state change and per generate heartbeat, Airflow's full log in a file.

``dag.test()`` prints Airflow's structured log (hundreds of lines) on stdout and stderr. Inside
:func:`quiet_console` both go to a log file instead, and a watcher thread prints to the real
terminal what a person follows: each task's state as it changes, with the seconds since the run
started, and the generate tasks' heartbeats (rollouts done, tok/s) read from that file.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

HEARTBEAT = re.compile(r"(shard \d+): (\d+/\d+ rollouts done), \d+ calls, \d+ tokens \((\d+ tok/s)\)")
POLL_SECONDS = 1.0


@contextlib.contextmanager
def quiet_console(dag_id: str, log_path: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (and its children's) to ``log_path``; print progress lines instead."""
    terminal = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    saved = [os.dup(fd) for fd in (1, 2)]
    sys.stdout.flush()
    sys.stderr.flush()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    print(f"      Airflow's full log: {log_path}", file=terminal)
    watcher = _Watcher(dag_id, log_path, terminal)
    watcher.start()
    try:
        yield
    finally:
        watcher.stop()
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        terminal.close()


class _Watcher(threading.Thread):
    """Polls the metadata DB for the newest run's task states and the log file for heartbeats."""

    def __init__(self, dag_id: str, log_path: Path, terminal: IO[str]) -> None:
        super().__init__(daemon=True, name="demo-console")
        self._dag_id, self._log_path, self._terminal = dag_id, log_path, terminal
        self._done = threading.Event()
        self._run_started = time.monotonic()
        self._states: dict[str, str] = {}
        self._beats: dict[str, str] = {}
        self._read_from = log_path.stat().st_size if log_path.exists() else 0
        self._after = self._newest_run_id()  # runs of earlier demos are not this one

    def run(self) -> None:
        while not self._done.wait(POLL_SECONDS):
            self._poll()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10)
        self._poll()

    def _say(self, line: str) -> None:
        self._terminal.write(f"  {time.monotonic() - self._run_started:5.0f} s  {line}\n")

    def _poll(self) -> None:
        with contextlib.suppress(Exception):  # a busy SQLite or a half-written line: next poll
            for task, state in self._task_states().items():
                if self._states.get(task) != state:
                    self._states[task] = state
                    self._say(f"{task.ljust(24)} {state}")
        with contextlib.suppress(OSError):
            with open(self._log_path, errors="replace") as log:
                log.seek(self._read_from)
                text = log.read()
                self._read_from = log.tell()
            for shard, done, rate in HEARTBEAT.findall(text):
                if self._beats.get(shard) != done:
                    self._beats[shard] = done
                    self._say(f"generate {shard}: {done}, {rate}")

    def _newest_run_id(self) -> int:
        from airflow import settings
        from airflow.models import DagRun

        with settings.Session() as session:
            run = session.query(DagRun).filter(DagRun.dag_id == self._dag_id).order_by(DagRun.id.desc()).first()
            return 0 if run is None else run.id

    def _task_states(self) -> dict[str, str]:
        from airflow import settings
        from airflow.models import DagRun, TaskInstance

        with settings.Session() as session:
            run = session.query(DagRun).filter(DagRun.dag_id == self._dag_id).order_by(DagRun.id.desc()).first()
            if run is None or run.id <= self._after:
                return {}
            instances = session.query(TaskInstance).filter(
                TaskInstance.dag_id == self._dag_id, TaskInstance.run_id == run.run_id
            )
            return {
                ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]": str(ti.state or "scheduled")
                for ti in instances
            }
