"""Engine processes end with the process that started them, even when it is killed with SIGKILL.

vLLM runs its engine core and workers in child processes. When their parent is killed outright
(``kill -9``, the OOM killer, a lost container) they do not notice: they wait on sockets nobody
writes to again, holding gigabytes of memory (GPU memory, on a GPU), and the retry's engine
starts next to them. :func:`reap_with_this_process` starts a watchdog, a small process that
holds the read end of a pipe whose only writer is this process. However this process ends, the
kernel closes that pipe; the watchdog reads EOF and stops the processes it was given (SIGTERM,
then SIGKILL after a grace period). Each is named by pid and start time, so a reused pid is
never signalled. Run as ``python -m tasks.engines.reaper GRACE PID:START ...``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Sequence

import psutil

GRACE_SECONDS = 5.0


class Reaper:
    """The watchdog of one engine's processes; :meth:`stop` ends it without touching them."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    def stop(self) -> None:
        """End the watchdog (the engine was shut down in order): idempotent."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        if self._process.stdin is not None:
            self._process.stdin.close()


def reap_with_this_process(processes: Sequence[psutil.Process], *, grace: float = GRACE_SECONDS) -> Reaper:
    """Start a watchdog that stops ``processes`` once this process has ended, however it ends."""
    named = [f"{p.pid}:{p.create_time()!r}" for p in processes]
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "tasks.engines.reaper", str(grace), *named],
        stdin=subprocess.PIPE,  # this process holds the only write end: EOF when it ends
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a signal to this process's group (Ctrl-C) leaves it waiting for the EOF
    )
    return Reaper(watchdog)


def _watch(grace: float, named: Sequence[str]) -> None:
    """Block until stdin reaches EOF, then stop each named process that is still the one named."""
    targets = []
    for item in named:
        pid, start = item.split(":", 1)
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(int(pid))
            if process.create_time() == float(start):
                targets.append(process)
    sys.stdin.buffer.read()
    for process in targets:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(targets, timeout=grace)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


if __name__ == "__main__":
    _watch(float(sys.argv[1]), sys.argv[2:])
