"""The reaper's watchdog stops an engine's processes once the process that started them is gone, however it went.

Real processes: a parent (standing in for ``rollout-ledger generate``) starts two long sleepers
(standing in for the engine's processes) and their watchdog; the test then kills the parent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

PARENT = """
import json, subprocess, sys, time
import psutil
from tasks.engines.reaper import reap_with_this_process
sleepers = [subprocess.Popen([sys.executable, "-c", sys.argv[1]]) for _ in range(2)]
reaper = reap_with_this_process([psutil.Process(p.pid) for p in sleepers], grace=float(sys.argv[2]))
if sys.argv[3] == "stop":
    reaper.stop()
print(json.dumps({"sleepers": [p.pid for p in sleepers], "watchdog": reaper.pid}), flush=True)
time.sleep(600)
"""
SLEEPER = "import time; time.sleep(600)"
IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def start_parent(sleeper: str, *, grace: float = 5.0, stop: bool = False) -> tuple[subprocess.Popen, dict]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, sleeper, str(grace), "stop" if stop else "watch"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    return parent, json.loads(parent.stdout.readline())


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.mark.parametrize("sleeper", [SLEEPER, IGNORES_SIGTERM], ids=["stops-on-sigterm", "ignores-sigterm"])
def test_the_engine_processes_end_when_their_parent_is_killed_with_sigkill(sleeper):
    parent, pids = start_parent(sleeper, grace=1.0)
    assert all(running(p) for p in pids["sleepers"])
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert wait_until_gone(pids["sleepers"], timeout=10) == []
    assert wait_until_gone([pids["watchdog"]], timeout=10) == []


def test_a_stopped_reaper_leaves_the_processes_alone():
    parent, pids = start_parent(SLEEPER, stop=True)
    try:
        assert wait_until_gone([pids["watchdog"]], timeout=10) == []
        parent.kill()
        parent.wait()
        time.sleep(1.0)
        assert all(running(p) for p in pids["sleepers"])
    finally:
        for pid in pids["sleepers"]:
            os.kill(pid, signal.SIGKILL)
