"""The reaper stops the processes its parent started after it, once the parent is gone, however it went.

Real processes: a parent (standing in for ``rollout-ledger generate``) starts one sleeper, then
its reaper, then two sleepers standing in for the engine's processes (one by exec, as vLLM's
``spawn`` does, one by fork, vLLM's default elsewhere), tells the reaper the engine has started
and starts one more sleeper; the test then kills the parent, or the parent dies at once, or asks
its reaper to reap or to stop. The real engine's start-up: tests/engines/test_vllm_start_kill.py.
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
import json, os, signal, subprocess, sys, time
from tasks.engines.reaper import Reaper
sleeper, grace, scan_seconds, then = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]

def start(how):
    if how == "exec":
        return subprocess.Popen([sys.executable, "-c", sleeper]).pid
    pid = os.fork()
    if pid == 0:
        try:
            exec(sleeper)
        finally:
            os._exit(0)
    return pid

before = start("exec")
reaper = Reaper.start(grace=grace, scan_seconds=scan_seconds)
engine = [start("exec"), start("fork")]
pids = {"before": before, "engine": engine, "watchdog": reaper.pid}
if then == "die-at-once":
    print(json.dumps(pids), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if then == "reap":
    reaper.reap()
else:
    reaper.started()
pids["after"] = start("exec")
if then == "stop":
    reaper.stop()
print(json.dumps(pids), flush=True)
time.sleep(600)
"""
SLEEPER = "import time; time.sleep(600)"
IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
STARTS_ITS_OWN = (
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "time.sleep(600)"
)


def start_parent(
    sleeper: str, *, then: str = "started", grace: float = 5.0, scan_seconds: float = 0.1
) -> tuple[subprocess.Popen, dict]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, sleeper, str(grace), str(scan_seconds), then],
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


def bystanders(pids: dict) -> list[int]:
    return [pids["before"], *([pids["after"]] if "after" in pids else [])]


@pytest.mark.parametrize(
    "sleeper", [SLEEPER, IGNORES_SIGTERM, STARTS_ITS_OWN], ids=["stops-on-sigterm", "ignores-sigterm", "starts-its-own"]
)
def test_the_engine_processes_end_when_their_parent_is_killed_with_sigkill(sleeper):
    parent, pids = start_parent(sleeper, grace=1.0)
    grandchildren = descendants(pids["engine"], at_least=2) if sleeper == STARTS_ITS_OWN else []
    try:
        assert all(running(p) for p in pids["engine"] + grandchildren)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_until_gone(pids["engine"] + grandchildren, timeout=15) == []
        assert wait_until_gone([pids["watchdog"]], timeout=10) == []
        assert all(running(p) for p in bystanders(pids)), "processes started before the reaper or after started()"
    finally:
        end(pids["engine"] + grandchildren + bystanders(pids))


def test_processes_started_after_the_watchdogs_last_look_are_found_when_the_parent_dies():
    parent, pids = start_parent(SLEEPER, then="die-at-once", scan_seconds=3600)  # it looks once, at its start
    try:
        parent.wait()
        assert wait_until_gone(pids["engine"], timeout=15) == []
        assert wait_until_gone([pids["watchdog"]], timeout=10) == []
        assert running(pids["before"])
    finally:
        end(pids["engine"] + bystanders(pids))


def test_reap_stops_the_engine_processes_now_and_leaves_the_parent_running():
    parent, pids = start_parent(SLEEPER, then="reap")
    try:
        assert wait_until_gone(pids["engine"] + [pids["watchdog"]], timeout=1) == []
        assert parent.poll() is None
        assert all(running(p) for p in bystanders(pids))
    finally:
        parent.kill()
        parent.wait()
        end(pids["engine"] + bystanders(pids))


def test_a_stopped_reaper_leaves_the_processes_alone():
    parent, pids = start_parent(SLEEPER, then="stop")
    try:
        assert wait_until_gone([pids["watchdog"]], timeout=10) == []
        parent.kill()
        parent.wait()
        time.sleep(1.0)
        assert all(running(p) for p in pids["engine"])
    finally:
        end(pids["engine"] + bystanders(pids))
