"""The agents' watchdog process: ``python -m tasks.environments.agent_watchdog WORKER_PID``.

It reads ``+PGID`` (an agent's process group started) and ``-PGID`` (it ended) lines on stdin.
When stdin closes (the worker exited or was killed: the kernel closes its end of the pipe) or
the worker is gone, it SIGKILLs every group it still holds, and the processes those groups
started that left them, then exits. See :class:`tasks.environments.agent_process.AgentWatchdog`.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys

import psutil

from tasks.environments.agent_process import kill_group

POLL_SECONDS = 0.5


def _kill_all(groups: set[int]) -> None:
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) in groups:
                members += [process, *process.children(recursive=True)]
    for pgid in groups:
        kill_group(pgid)
    for process in members:
        with contextlib.suppress(psutil.Error):
            process.kill()


def watch(worker: int) -> None:
    groups: set[int] = set()
    pending = b""
    while True:  # every line the worker wrote is read, even when it died before this process started reading
        readable, _, _ = select.select([0], [], [], POLL_SECONDS)
        if not readable:
            if os.getppid() != worker:  # gone, yet someone holds the pipe open
                break
            continue
        data = os.read(0, 4096)
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            sign, pgid = line[:1], int(line[1:])
            (groups.add if sign == b"+" else groups.discard)(pgid)
    _kill_all(groups)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
