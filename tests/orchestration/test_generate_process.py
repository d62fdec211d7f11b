"""The generate child process: its failures are classified, and it never outlives the task that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tasks.engines.vllm_server.options import API_KEY_ENV
from tasks.orchestration.generate_process import GenerateCommand, GenerateProcessError, run_generate, stop
from tasks.orchestration.storage_location import StorageLocation
from tasks.storage.options import STORAGE_OPTIONS_VARIABLE


def test_an_input_error_of_the_child_is_permanent_and_quoted(tmp_path):
    lines: list[str] = []
    command = GenerateCommand(StorageLocation(f"file://{tmp_path}"), "never-planned", 0, try_number=1)
    with pytest.raises(GenerateProcessError) as error:
        run_generate(command, log=lines.append)
    assert error.value.returncode == 2 and error.value.permanent
    assert "generate shard 0 exited 2 (usage or input error)" in str(error.value)
    assert "never-planned" in str(error.value) and any("never-planned" in line for line in lines)


def test_the_child_gets_its_secrets_on_stdin_never_in_its_argv_or_environment():
    location = StorageLocation("s3://bucket/runs", {"key": "k", "secret": "s"})
    command = GenerateCommand(location, "b1", 3, try_number=2, secrets={API_KEY_ENV: "server-key"})
    argv = command.argv("python")
    assert argv == [
        *("python", "-m", "tasks.generate.worker"),
        *("--root", "s3://bucket/runs", "--batch-id", "b1", "--shard", "3", "--secrets-on-stdin", "--try-number", "2"),
    ]
    worker = {STORAGE_OPTIONS_VARIABLE: "stale", API_KEY_ENV: "old", "PATH": "/bin", "AIRFLOW_HOME": "/a"}
    worker |= {"AIRFLOW__CORE__FERNET_KEY": "f", "AIRFLOW_CONN_S3": "s3://k:s@", "AIRFLOW_VAR_X": "x"}
    env = command.environment(worker)
    assert env == {"PATH": "/bin", "AIRFLOW_HOME": "/a", "OPENLINEAGE_DISABLED": "true"}  # lineage: the task's
    assert json.loads(command.handed_over()) == {
        "storage_options": {"key": "k", "secret": "s"},
        "environment": {API_KEY_ENV: "server-key"},
        "trigger_policy": {"servers": [], "models": []},
    }


def test_the_real_worker_reads_its_secrets_from_stdin_and_starts_without_them(tmp_path, monkeypatch):
    """The worker child of a real task start: its initial environment (what /proc shows) holds no planted secret."""
    dump = tmp_path / "environ"
    shim = tmp_path / "python"  # records the child's initial environment and stdin, then runs the real worker
    shim.write_text(
        f'#!/bin/sh\ncat /proc/self/environ > {dump}\nexec {sys.executable} "$@"\n',
    )
    shim.chmod(0o755)
    monkeypatch.setenv("AIRFLOW__CORE__FERNET_KEY", "planted-fernet")
    monkeypatch.setenv(STORAGE_OPTIONS_VARIABLE, '{"secret": "planted-storage"}')
    location = StorageLocation(f"file://{tmp_path}/runs", {"auto_mkdir": True})
    command = GenerateCommand(location, "never-planned", 0, secrets={API_KEY_ENV: "planted-server-key"})
    with pytest.raises(GenerateProcessError) as error:  # it read the hand-over, then found no batch
        run_generate(command, log=lambda line: None, python=str(shim))
    assert error.value.returncode == 2 and "never-planned" in str(error.value)
    environ = dump.read_bytes()
    assert environ and not any(s in environ for s in (b"planted-fernet", b"planted-storage", b"planted-server-key"))


@pytest.mark.parametrize("undumpable", [True, False])
def test_a_non_dumpable_process_hides_its_environment_from_its_own_user(undumpable):
    """Two processes of one unprivileged user (nobody): the reader gets the target's /proc environ unless the target
    made itself non-dumpable."""
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c"]
    target = (
        "import time; from tasks.process_memory import make_undumpable; "
        f"assert make_undumpable() if {undumpable} else True; print('ready', flush=True); time.sleep(30)"
    )
    env = {"PYTHONPATH": str(Path.cwd()), "PLANTED": "planted-in-the-environment", "PATH": "/usr/bin:/bin"}
    process = subprocess.Popen([*as_nobody, target], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        reader = f"print(open('/proc/{process.pid}/environ', 'rb').read().decode())"
        read = subprocess.run([*as_nobody, reader], capture_output=True, text=True, check=False)
    finally:
        process.kill()
        process.wait()
    if undumpable:
        assert read.returncode != 0 and "PermissionError" in read.stderr
    else:
        assert "planted-in-the-environment" in read.stdout


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
