"""Engine processes end with the process that started them, however it ends, from the first moment of start-up.

vLLM runs its engine core and workers in child processes. When their parent is killed outright
(``kill -9``, the OOM killer, a lost container) they do not notice: they wait on sockets nobody
writes to again, holding gigabytes of memory (GPU memory, on a GPU), and the retry's engine
starts next to them. Start-up takes 30-80 s, and a kill can land anywhere in it.

A :class:`Reaper` is a watchdog process started just before the engine (:meth:`Reaper.start`
returns once it has seen what was already there). Until told the engine has started
(:meth:`Reaper.started`) it looks at its parent's process tree every ``scan_seconds`` and
remembers every process that was not there when it started; the engine's processes are those
and whatever they start. It waits until its parent has ended (the kernel gives the watchdog
another parent) or asks it to reap (:meth:`Reaper.reap`), then stops the remembered processes
and their descendants: SIGTERM, then SIGKILL after a grace period, again until none is left. A
process started after the last look and before the parent died is found too: the parent's
orphans go where the watchdog went, so the watchdog takes the processes of its new parent that
are in its old parent's process group and were born since that last look.

What a process carries cannot mark it: vLLM's processes rename themselves (``VLLM::EngineCore``),
which on Linux overwrites the environment ``/proc`` shows, and its ``spawn`` start method closes
inherited file descriptors. Nor is a process group of their own an option: they inherit their
parent's, and moving the parent would take it out of its terminal's foreground group (Ctrl-C).

multiprocessing's resource tracker is started before the watchdog (unless the caller says it needs
none): it must outlive its users to remove what they leaked, and it ends by itself once they are gone.
Processes other than the engine's that this process starts during the engine's start-up are taken for
the engine's.
Run as ``python -m tasks.engines.reaper OWNER GRACE SCAN_SECONDS``.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterable
from multiprocessing import resource_tracker

import psutil

GRACE_SECONDS = 5.0
SCAN_SECONDS = 0.1  # how often the watchdog looks at its parent's tree during start-up
POLL_SECONDS = 0.2  # how often it checks that its parent is alive
BIRTH_SLACK_SECONDS = 0.05  # start times in /proc have clock-tick resolution
KILL_ROUNDS = 5
WATCHING = b"watching\n"  # the watchdog's answers on its stdout
STARTED = b"started\n"


class Reaper:
    """The watchdog of the processes one engine starts. Start it with :meth:`start`, just before the engine."""

    def __init__(self, watchdog: subprocess.Popen[bytes]) -> None:
        self._watchdog = watchdog

    @classmethod
    def start(
        cls, *, grace: float = GRACE_SECONDS, scan_seconds: float = SCAN_SECONDS, resource_tracker_first: bool = True
    ) -> Reaper:
        """Start a watchdog for the processes this process starts from now on, until :meth:`started`.

        ``resource_tracker_first``: start multiprocessing's resource tracker before the watchdog, so it
        is not taken for the engine's (needed where the engine uses multiprocessing, as vLLM's does;
        a launcher that only runs a program of its own passes ``False``)."""
        if resource_tracker_first:
            resource_tracker.ensure_running()
        watchdog = subprocess.Popen(
            [sys.executable, "-m", "tasks.engines.reaper", str(os.getpid()), str(grace), str(scan_seconds)],
            stdin=subprocess.PIPE,  # started() and reap() write a line here
            stdout=subprocess.PIPE,  # it answers here: it has looked
            start_new_session=True,  # a signal to this process's group (Ctrl-C) does not reach it
        )
        reaper = cls(watchdog)
        if not reaper._answered(WATCHING):
            reaper.stop()
            raise RuntimeError(f"the engine watchdog did not start (exit status {watchdog.returncode})")
        return reaper

    @property
    def pid(self) -> int:
        return self._watchdog.pid

    def started(self) -> None:
        """The engine is up: what was started so far is the engine's, what comes later is not (returns after a look)."""
        if self._send(b"started\n"):
            self._answered(STARTED)

    def _answered(self, answer: bytes) -> bool:
        return self._watchdog.stdout is not None and self._watchdog.stdout.readline() == answer

    def reap(self) -> None:
        """Stop the engine's processes now, as if this process had ended, and wait for the watchdog to finish."""
        if self._send(b"reap\n"):
            self._watchdog.wait()
        self._close()

    def stop(self) -> None:
        """End the watchdog and leave the processes alone (the engine was shut down in order): idempotent."""
        if self._watchdog.poll() is None:
            self._watchdog.kill()
            self._watchdog.wait()
        self._close()

    def _send(self, line: bytes) -> bool:
        if self._watchdog.poll() is not None or self._watchdog.stdin is None or self._watchdog.stdin.closed:
            return False
        try:
            self._watchdog.stdin.write(line)
            self._watchdog.stdin.flush()
        except BrokenPipeError:
            return False
        return True

    def _close(self) -> None:
        for pipe in (self._watchdog.stdin, self._watchdog.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()


def _since_boot(process: psutil.Process) -> float:
    """When ``process`` started, in seconds since boot (the clock of ``CLOCK_BOOTTIME``)."""
    return process.create_time() - psutil.boot_time()


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Watch:
    """What the watchdog knows: its parent, the processes that were there before, and those born since."""

    def __init__(self, owner: psutil.Process) -> None:
        self.owner = owner
        self.group = os.getpgid(owner.pid)
        self.me = os.getpid()
        self.before = {(p.pid, p.create_time()) for p in owner.children(recursive=True)}
        self.born: dict[int, psutil.Process] = {}
        self.last_scan = time.clock_gettime(time.CLOCK_BOOTTIME)

    def scan(self) -> None:
        """Remember every process of the parent's tree that was not there before (this one aside)."""
        self.last_scan = time.clock_gettime(time.CLOCK_BOOTTIME)
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in self.owner.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    if process.pid != self.me and (process.pid, process.create_time()) not in self.before:
                        self.born.setdefault(process.pid, process)

    def orphans_since_last_scan(self) -> list[psutil.Process]:
        """Processes the dead parent's tree started after the last scan: re-parented where this one was."""
        found = []
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in psutil.Process(os.getppid()).children():
                with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                    if (
                        process.pid != self.me
                        and os.getpgid(process.pid) == self.group
                        and _since_boot(process) >= self.last_scan - BIRTH_SLACK_SECONDS
                    ):
                        found.append(process)
        return found


def _stop_processes(processes: Iterable[psutil.Process], *, grace: float) -> None:
    """SIGTERM ``processes`` and their descendants, SIGKILL what is left after ``grace`` s, again until none is."""
    targets = _with_descendants({p.pid: p for p in processes})
    for process in targets.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _wait_ended(targets.values(), grace)
    for _ in range(KILL_ROUNDS):
        targets = _with_descendants(targets)
        left = [p for p in targets.values() if _running(p)]
        if not left:
            return
        for process in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        _wait_ended(left, 1.0)


def _with_descendants(processes: dict[int, psutil.Process]) -> dict[int, psutil.Process]:
    found = dict(processes)
    for process in processes.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in process.children(recursive=True):
                found.setdefault(child.pid, child)
    return found


def _wait_ended(processes: Iterable[psutil.Process], timeout: float) -> None:
    """Wait up to ``timeout`` s until each of ``processes`` has ended (a zombie has: only its parent can reap it)."""
    processes = list(processes)
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)


def _watch(owner_pid: int, grace: float, scan_seconds: float) -> None:
    """Remember the parent's new processes until ``started``; when the parent is gone (or on ``reap``), stop them."""
    try:
        watch = _Watch(psutil.Process(owner_pid))
    except psutil.NoSuchProcess:
        return  # the parent died before anything could be watched: it started nothing after us
    _answer(WATCHING)
    scanning, next_scan, pending = True, 0.0, b""
    while os.getppid() == owner_pid:
        if scanning and time.monotonic() >= next_scan:
            watch.scan()
            next_scan = time.monotonic() + scan_seconds
        readable, _, _ = select.select([0], [], [], min(POLL_SECONDS, scan_seconds) if scanning else POLL_SECONDS)
        if not readable:
            continue
        data = os.read(0, 4096)
        if not data:  # EOF: the parent is exiting; its children are re-parented in a moment
            _wait_for_new_parent(owner_pid)
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        if b"reap" in lines:
            if scanning:
                watch.scan()
            break
        if b"started" in lines:
            watch.scan()
            scanning = False
            _answer(STARTED)
    orphans = watch.orphans_since_last_scan() if scanning and os.getppid() != owner_pid else []
    _stop_processes([*watch.born.values(), *orphans], grace=grace)


def _answer(answer: bytes) -> None:
    with contextlib.suppress(BrokenPipeError):  # the parent is gone: reaping comes next
        os.write(1, answer)


def _wait_for_new_parent(owner_pid: int, timeout: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while os.getppid() == owner_pid and time.monotonic() < deadline:
        time.sleep(0.01)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
