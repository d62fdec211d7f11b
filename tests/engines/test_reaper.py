"""The reaper stops the processes started inside its marking block once the process that started them is gone.

Real processes: a parent (standing in for ``rollout-ledger generate``) starts its reaper, then,
inside the marking block, one sleeper by exec (as vLLM's ``spawn`` does) and one by fork (vLLM's
default), and after the block one unmarked sleeper; the test then kills the parent, or the parent
asks its reaper to reap or to stop. The real engine's start-up is covered by
tests/engines/test_vllm_start_kill.py.
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
import json, os, subprocess, sys, time
from tasks.engines.reaper import Reaper
sleeper, grace, then = sys.argv[1], float(sys.argv[2]), sys.argv[3]

def forked_sleeper():
    pid = os.fork()
    if pid == 0:
        try:
            exec(sleeper)
        finally:
            os._exit(0)
    return pid

reaper = Reaper.start(grace=grace)
with reaper.marking():
    marked = [subprocess.Popen([sys.executable, "-c", sleeper]).pid, forked_sleeper()]
unmarked = subprocess.Popen([sys.executable, "-c", sleeper]).pid
if then == "stop":
    reaper.stop()
elif then == "reap":
    reaper.reap()
print(json.dumps({"marked": marked, "unmarked": unmarked, "watchdog": reaper.pid}), flush=True)
time.sleep(600)
"""
SLEEPER = "import time; time.sleep(600)"
IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
STARTS_ITS_OWN = (
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "time.sleep(600)"
)


def start_parent(sleeper: str, *, grace: float = 5.0, then: str = "watch") -> tuple[subprocess.Popen, dict]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, sleeper, str(grace), then],
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


def descendants(pids: list[int], *, at_least: int, timeout: float = 30.0) -> list[int]:
    """The processes ``pids`` have started, once there are ``at_least`` of them."""
    deadline = time.monotonic() + timeout
    while True:
        found = [c.pid for pid in pids for c in psutil.Process(pid).children(recursive=True)]
        if len(found) >= at_least or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def end(pids: list[int]) -> None:
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "sleeper", [SLEEPER, IGNORES_SIGTERM, STARTS_ITS_OWN], ids=["stops-on-sigterm", "ignores-sigterm", "starts-its-own"]
)
def test_the_marked_processes_end_when_their_parent_is_killed_with_sigkill(sleeper):
    parent, pids = start_parent(sleeper, grace=1.0)
    grandchildren = descendants(pids["marked"], at_least=2) if sleeper == STARTS_ITS_OWN else []
    try:
        assert all(running(p) for p in pids["marked"] + grandchildren)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_until_gone(pids["marked"] + grandchildren, timeout=15) == []
        assert wait_until_gone([pids["watchdog"]], timeout=10) == []
        assert running(pids["unmarked"]), "a process started after the marking block is not the engine's"
    finally:
        end(pids["marked"] + grandchildren + [pids["unmarked"]])


def test_reap_stops_the_marked_processes_now_and_leaves_the_parent_running():
    parent, pids = start_parent(SLEEPER, then="reap")
    try:
        assert wait_until_gone(pids["marked"] + [pids["watchdog"]], timeout=1) == []
        assert parent.poll() is None
        assert running(pids["unmarked"])
    finally:
        parent.kill()
        parent.wait()
        end(pids["marked"] + [pids["unmarked"]])


def test_a_stopped_reaper_leaves_the_processes_alone():
    parent, pids = start_parent(SLEEPER, then="stop")
    try:
        assert wait_until_gone([pids["watchdog"]], timeout=10) == []
        parent.kill()
        parent.wait()
        time.sleep(1.0)
        assert all(running(p) for p in pids["marked"])
    finally:
        end(pids["marked"] + [pids["unmarked"]])


def test_a_reaper_marks_once():
    from tasks.engines.reaper import Reaper

    reaper = Reaper.start()
    try:
        with reaper.marking():
            pass
        with pytest.raises(RuntimeError, match="marked its processes already"), reaper.marking():
            pass
    finally:
        reaper.stop()
