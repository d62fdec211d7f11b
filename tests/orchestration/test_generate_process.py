"""The generate child process: its failures are classified, and it never outlives the task that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tasks.orchestration.generate_process import GenerateCommand, GenerateProcessError, run_generate, stop
from tasks.orchestration.storage_location import StorageLocation


def test_an_input_error_of_the_child_is_permanent_and_quoted(tmp_path):
    lines: list[str] = []
    command = GenerateCommand(StorageLocation(f"file://{tmp_path}"), "never-planned", 0, try_number=1)
    with pytest.raises(GenerateProcessError) as error:
        run_generate(command, log=lines.append)
    assert error.value.returncode == 2 and error.value.permanent
    assert "generate shard 0 exited 2 (usage or input error)" in str(error.value)
    assert "never-planned" in str(error.value) and any("never-planned" in line for line in lines)


def test_the_child_gets_the_storage_options_in_its_environment_only():
    location = StorageLocation("s3://bucket/runs", {"key": "k", "secret": "s"})
    command = GenerateCommand(location, "b1", 3, try_number=2)
    argv = command.argv("python")
    assert argv == [
        *("python", "-m", "tasks.generate.worker"),
        *("--root", "s3://bucket/runs", "--batch-id", "b1", "--shard", "3", "--try-number", "2"),
    ]
    env = command.environment({"ROLLOUT_LEDGER_STORAGE_OPTIONS": "stale", "PATH": "/bin"})
    assert env["PATH"] == "/bin" and '"secret": "s"' in env["ROLLOUT_LEDGER_STORAGE_OPTIONS"]
    assert env["OPENLINEAGE_DISABLED"] == "true"  # the task reports generate's lineage, never the child too


@pytest.fixture
def fake_python(tmp_path):
    """A fake interpreter: logs a line, then waits; SIGTERM makes it log 'stopped' and exit 143."""
    script = tmp_path / "fake-python"
    script.write_text("#!/bin/sh\ntrap 'echo stopped >&2; exit 143' TERM\necho started >&2\nsleep 60 &\nwait\n")
    script.chmod(0o755)
    return str(script)


def test_an_exception_while_waiting_stops_the_child_first(tmp_path, fake_python):
    """Airflow's execution timeout raises inside the task while it waits: the child is stopped, then it propagates."""
    lines: list[str] = []

    def timeout(signum, frame):
        raise TimeoutError("execution_timeout")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(2)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            run_generate(
                GenerateCommand(StorageLocation(f"file://{tmp_path}"), "b", 0), log=lines.append, python=fake_python
            )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 30
    assert lines[0] == "started" and "stopped" in lines and any("SIGTERM" in line for line in lines)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period():
    child = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(15, signal.SIG_IGN); time.sleep(60)"]
    )
    time.sleep(0.5)
    stop(child, log=lambda line: None, grace=1.0)
    assert child.returncode == -signal.SIGKILL


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_is_stopped_when_the_task_process_dies():
    parent_code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'from tasks.generate.worker import "
        "stop_with_parent; stop_with_parent(); import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, env=os.environ)
    child_pid = int(parent.stdout.readline())
    time.sleep(1.0)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child_pid) and psutil.Process(child_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.1)
