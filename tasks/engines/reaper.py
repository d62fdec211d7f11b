"""Engine processes end with the process that started them, however it ends, from the first moment of start-up.

vLLM runs its engine core and workers in child processes. When their parent is killed outright
(``kill -9``, the OOM killer, a lost container) they do not notice: they wait on sockets nobody
writes to again, holding gigabytes of memory (GPU memory, on a GPU), and the retry's engine
starts next to them. Start-up takes 30-80 s, and a kill can land anywhere in it.

A :class:`Reaper` is a watchdog process, started before the engine. Every process started inside
its :meth:`Reaper.marking` block (the engine's start) carries two marks, and passes them on to
the processes it starts in turn:

* an environment variable holding the reaper's token: inherited by every program executed
  (vLLM's ``spawn`` start method, and whatever the engine processes run);
* an open file descriptor of the reaper's marker pipe: inherited by every ``fork`` (vLLM's default
  start method), which leaves ``/proc/PID/environ`` as it was when the parent started.

The watchdog waits until its parent has ended (the kernel gives it another parent) or asks it to
reap (:meth:`Reaper.reap`), then stops every process that carries a mark: SIGTERM, then SIGKILL
after a grace period, scanning again until none is left. Marks are found by scanning
``/proc`` when it is time to reap, so a process started an instant before the kill is found as
surely as one started a minute earlier; the parent's process tree would not do, as its
processes are re-parented the moment it dies. multiprocessing's resource tracker is started
before the marks are set: it must outlive its users to remove what they leaked, and it ends by
itself once they are gone. Run as ``python -m tasks.engines.reaper OWNER GRACE TOKEN MARKER``.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from multiprocessing import resource_tracker

import psutil

GRACE_SECONDS = 5.0
POLL_SECONDS = 0.2  # how often the watchdog looks at its parent pid
KILL_ROUNDS = 5
MARK_VARIABLE = "ROLLOUT_LEDGER_ENGINE_REAPER"


class Reaper:
    """The watchdog of the processes one engine starts. Start it with :meth:`start`, before the engine."""

    def __init__(self, watchdog: subprocess.Popen[bytes], token: str, marker_fd: int) -> None:
        self._watchdog = watchdog
        self._token = token
        self._marker_fd: int | None = marker_fd

    @classmethod
    def start(cls, *, grace: float = GRACE_SECONDS) -> Reaper:
        """Start a watchdog for this process; nothing is marked until :meth:`marking`."""
        resource_tracker.ensure_running()
        read_end, marker_fd = os.pipe()  # non-inheritable across exec: only forks share the write end
        os.close(read_end)
        token = uuid.uuid4().hex
        watchdog = subprocess.Popen(
            [sys.executable, "-m", "tasks.engines.reaper", str(os.getpid()), str(grace), token, _pipe_link(marker_fd)],
            stdin=subprocess.PIPE,  # reap() writes a line here
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a signal to this process's group (Ctrl-C) does not reach it
        )
        return cls(watchdog, token, marker_fd)

    @property
    def pid(self) -> int:
        return self._watchdog.pid

    @contextlib.contextmanager
    def marking(self) -> Iterator[None]:
        """Within the block, every process started from this one (and all they start) carries this reaper's marks.

        One block per reaper: at its end the marker pipe is closed here (the marked processes keep
        theirs) and the environment is restored, so processes started later are not marked.
        """
        if self._marker_fd is None:
            raise RuntimeError("this reaper has marked its processes already")
        saved = os.environ.get(MARK_VARIABLE)
        os.environ[MARK_VARIABLE] = self._token
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(MARK_VARIABLE, None)
            else:
                os.environ[MARK_VARIABLE] = saved
            self._close_marker()

    def reap(self) -> None:
        """Stop every marked process now, as if this process had ended, and wait for the watchdog to finish."""
        if self._watchdog.poll() is None and self._watchdog.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._watchdog.stdin.write(b"reap\n")
                self._watchdog.stdin.flush()
            self._watchdog.wait()
        self._release()

    def stop(self) -> None:
        """End the watchdog and leave the marked processes alone (the engine was shut down in order): idempotent."""
        if self._watchdog.poll() is None:
            self._watchdog.kill()
            self._watchdog.wait()
        self._release()

    def _release(self) -> None:
        self._close_marker()
        if self._watchdog.stdin is not None:
            self._watchdog.stdin.close()

    def _close_marker(self) -> None:
        if self._marker_fd is not None:
            os.close(self._marker_fd)
            self._marker_fd = None


def _pipe_link(fd: int) -> str:
    """How ``/proc/PID/fd/N`` reads for a descriptor of the pipe ``fd`` belongs to."""
    return f"pipe:[{os.fstat(fd).st_ino}]"


def marked_processes(token: str, marker: str, *, exclude: frozenset[int] = frozenset()) -> list[psutil.Process]:
    """Running processes (this user's: others' cannot be read) that carry the mark ``token`` or hold ``marker``."""
    found = []
    for process in psutil.process_iter():
        if process.pid in exclude:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if process.environ().get(MARK_VARIABLE) == token or _holds(process.pid, marker):
                found.append(process)
    return found


def _holds(pid: int, marker: str) -> bool:
    folder = f"/proc/{pid}/fd"
    for fd in os.listdir(folder):
        with contextlib.suppress(OSError):
            if os.readlink(f"{folder}/{fd}") == marker:
                return True
    return False


def stop_marked(token: str, marker: str, *, grace: float, exclude: frozenset[int] = frozenset()) -> None:
    """SIGTERM every marked process, SIGKILL what is left after ``grace`` s, and again until none is left."""
    targets = marked_processes(token, marker, exclude=exclude)
    for process in targets:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _wait_ended(targets, grace)
    for _ in range(KILL_ROUNDS):
        left = marked_processes(token, marker, exclude=exclude)
        if not left:
            return
        for process in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        _wait_ended(left, 1.0)


def _wait_ended(processes: list[psutil.Process], timeout: float) -> None:
    """Wait up to ``timeout`` s until each of ``processes`` has ended (a zombie has: only its parent can reap it)."""
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _watch(owner: int, grace: float, token: str, marker: str) -> None:
    """Wait until ``owner`` (the parent) has ended or stdin has a line (or EOF), then stop the marked processes."""
    while os.getppid() == owner:
        readable, _, _ = select.select([sys.stdin], [], [], POLL_SECONDS)
        if readable:
            break
    stop_marked(token, marker, grace=grace, exclude=frozenset({os.getpid(), owner}))


if __name__ == "__main__":
    _watch(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4])
