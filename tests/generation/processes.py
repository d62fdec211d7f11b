"""A real ``rollout-ledger generate`` process that tests stop, signal or kill, and what it leaves running."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from tasks.engines.vllm.engine import engine_processes

PROGRESS = re.compile(r"shard 0: (\d+)/(\d+) rollouts done")
ENGINE_START_TIMEOUT = 300


class GenerateProcess:
    """``rollout-ledger generate`` of shard 0 in its own session (a whole-group signal reaches only it and its engine).

    ``env`` adds variables to this process's environment (a crash point, for example).
    """

    def __init__(self, root: str, batch_id: str, log: Path, *, env: Mapping[str, str] | None = None) -> None:
        self.log = log
        self.handle = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tasks.cli", "generate", "--root", root, "--batch-id", batch_id, "--shard", "0"],
            stdout=subprocess.PIPE,
            stderr=self.handle,
            start_new_session=True,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def wait_for_completed_rollouts(self) -> int:
        """Block until the heartbeat reports at least one, but not every, rollout done; return how many."""
        deadline = time.monotonic() + ENGINE_START_TIMEOUT
        while time.monotonic() < deadline:
            done = [(int(d), int(t)) for d, t in PROGRESS.findall(self.log.read_text())]
            if done and 0 < done[-1][0] < done[-1][1]:
                return done[-1][0]
            assert self.process.poll() is None, f"generate ended early:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"no partial progress within {ENGINE_START_TIMEOUT} s:\n{self.log.read_text()[-3000:]}")

    def engine_processes(self) -> list[psutil.Process]:
        return engine_processes(psutil.Process(self.process.pid))

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        stdout, _ = self.process.communicate(timeout=timeout)
        self.handle.close()
        return self.process.returncode, stdout

    def session_survivors(self, grace: float = 5.0) -> list[int]:
        """Processes of this run's session still alive ``grace`` seconds after it exited."""
        deadline = time.monotonic() + grace
        while True:
            alive = []
            for process in psutil.process_iter(["pid", "status"]):
                try:
                    if os.getsid(process.pid) == self.process.pid and process.status() != psutil.STATUS_ZOMBIE:
                        alive.append(process.pid)
                except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
                    continue
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)
