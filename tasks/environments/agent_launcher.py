"""Start an agent command under its limits, tied to the worker: ``python -m tasks.environments.agent_launcher``.

Argv: ``WORKER_PID RLIMITS -- COMMAND...`` where RLIMITS is ``RLIMIT_AS=N,RLIMIT_CPU=N,...`` (may be
empty). In this process, before ``exec``: each rlimit is set (soft and hard), the kernel is asked
to SIGKILL this process when the worker's thread that started it ends (``PR_SET_PDEATHSIG``), and
the worker is checked to be still alive (it may have died before that request), and every file
descriptor but the three standard ones is closed. Then it execs the command (for a sandboxed
agent, ``bwrap`` and its arguments: :mod:`tasks.environments.agent_sandbox`) with the environment
it was given. An ``exec`` that fails writes
:data:`~tasks.environments.agent_process.LAUNCH_FAILED` and the reason to stderr and exits 127.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

from tasks.environments.agent_process import LAUNCH_FAILED

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    worker, settings, separator, *command = argv
    if separator != "--" or not command:
        sys.stderr.write(f"{LAUNCH_FAILED}: usage: WORKER_PID RLIMITS -- COMMAND...\n")
        os._exit(127)
    for setting in filter(None, settings.split(",")):
        name, value = setting.split("=")
        resource.setrlimit(getattr(resource, name), (int(value), int(value)))
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(worker):  # the worker died before the request above: nobody waits for us
        os._exit(137)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # nothing of the worker's but stdin, stdout and stderr
    try:
        os.execvp(command[0], command)
    except OSError as error:
        sys.stderr.write(f"{LAUNCH_FAILED} {command[0]!r}: {error}\n")
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
