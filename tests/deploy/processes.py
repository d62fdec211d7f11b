"""Long-running processes for deployment tests: start, wait until ready, stop every one of them, keep their logs.

Each service runs in its own process group (its own session), its stdout and stderr go to
``<log_dir>/<name>.log``, and :meth:`Services.stop` ends it in every path: the service's stop
signal to its whole group, then SIGKILL to the group and to every descendant seen before the
signal (a process that made its own session or lost its parent is still found). Airflow
components and Celery workers fork helpers that outlive a SIGTERM to their parent alone, which is
why groups, not pids, are signalled. Waits poll with a deadline and fail fast, with the tail of
every log, when a service exits early.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

LOG_TAIL_LINES = 40


def free_port() -> int:
    """A TCP port on loopback nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Service:
    """One started process (the leader of its process group) and the file its output goes to."""

    name: str
    process: subprocess.Popen
    log: Path
    stop_signal: int = signal.SIGTERM

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class ServiceFailedError(RuntimeError):
    """A service exited while something waited on it, or a wait ran out of time; the message has the logs' tails."""


@dataclass
class Services:
    """The services of one deployment; a context manager that stops them all (last started first) on exit."""

    log_dir: Path
    started: list[Service] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        cwd: Path | None = None,
        user: str | None = None,
        stop_signal: int = signal.SIGTERM,
    ) -> Service:
        """Start ``argv`` as the leader of a new process group, output to ``<log_dir>/<name>.log``."""
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                list(argv),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **_as_user(user),
            )
        service = Service(name, process, log, stop_signal)
        self.started.append(service)
        return service

    def run(self, name: str, argv: Sequence[str], env: Mapping[str, str], *, timeout: float, **options: Any) -> None:
        """Run ``argv`` to completion like :meth:`start` (log in the same place); raise unless it exits 0."""
        service = self.start(name, argv, env, **options)
        self.started.remove(service)
        try:
            returncode = service.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(service, grace=5)
            raise ServiceFailedError(f"{name}: still running after {timeout:.0f} s\n{service.tail()}") from None
        if returncode != 0:
            raise ServiceFailedError(f"{name} exited {returncode}\n{service.tail()}")

    def wait_until(self, what: str, ready: Callable[[], bool], *, timeout: float, interval: float = 1.0) -> None:
        """Poll ``ready()`` until it returns true; raise naming ``what`` on timeout or when a service exits."""
        deadline = time.monotonic() + timeout
        while True:
            dead = [s for s in self.started if not s.alive()]
            if dead:
                names = ", ".join(f"{s.name} (exit {s.process.returncode})" for s in dead)
                raise ServiceFailedError(f"waiting for {what}: {names} exited\n{self.tails()}")
            try:
                if ready():
                    return
            except Exception:  # not ready yet: connection refused, a 503, a missing table, ...
                pass
            if time.monotonic() > deadline:
                raise ServiceFailedError(f"{what}: not ready after {timeout:.0f} s\n{self.tails()}")
            time.sleep(interval)

    def tails(self) -> str:
        return "\n".join(f"--- {s.name} ({s.log}) ---\n{s.tail()}" for s in self.started)

    def stop(self, *, grace: float = 20.0) -> list[int]:
        """Stop every service, last started first; return the pids still alive afterwards (none, normally)."""
        leftovers = [pid for service in reversed(self.started) for pid in _stop_group(service, grace)]
        self.started.clear()
        return leftovers

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _as_user(user: str | None) -> dict:
    """Popen arguments that run the child as ``user`` (only when this process may switch users)."""
    if user is None or os.geteuid() != 0:
        return {}
    import pwd

    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _stop_group(service: Service, grace: float) -> list[int]:
    """Stop signal to the group, SIGKILL to what remains after ``grace``; return the pids still running."""
    pgid = service.process.pid  # the leader of its own session: its pid is the group id
    family = _descendants(service.process.pid)
    _signal_group(pgid, service.stop_signal)
    with contextlib.suppress(subprocess.TimeoutExpired):
        service.process.wait(timeout=grace)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_running(p.pid) for p in family):
        time.sleep(0.2)
    _signal_group(pgid, signal.SIGKILL)
    for proc in family:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        service.process.wait(timeout=10)
    pids = {pgid, *(p.pid for p in family), *_group_members(pgid)}
    return sorted(pid for pid in pids if _running(pid))


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _group_members(pgid: int) -> list[int]:
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
