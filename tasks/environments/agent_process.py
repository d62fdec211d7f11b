"""How an ``agent_command`` process runs: what it may see, what it may use, and that it ends with its attempt.

Agent commands run model-written tool code, so they are untrusted (docs/security.md):

* **Environment.** An allow-list, never the worker's: ``PATH``, ``LANG`` and ``LC_*``, a fresh
  ``HOME`` and ``TMPDIR`` (one folder per rollout, removed afterwards), the rollout's three
  variables, and the worker variables the registry entry names (:func:`agent_environment`).
  Storage credentials, server keys, ``AIRFLOW__*`` and cloud variables reach it only by name.
* **Limits.** :class:`AgentLimits`: address space, CPU seconds, open files and processes as
  rlimits, set by the launcher (``python -m tasks.environments.agent_launcher``) in the agent's
  own process before it execs the command (no ``preexec_fn`` in a threaded worker); stdout and
  stderr are read up to ``output_bytes`` each, and past it the rollout fails
  (``agent_output_limit``) without the worker holding more.
* **Lifetime.** Each agent leads a process group of its own. Its group is killed when its episode
  ends (whatever it left running too), and an :class:`AgentWatchdog` (one process per attempt)
  kills every group still listed when the worker dies, SIGKILL included. The launcher also asks
  the kernel to SIGKILL the agent when the worker's thread that started it ends
  (``PR_SET_PDEATHSIG``). A process that leaves its group (``setsid``) escapes both: limits
  (``processes``) and the episode's time-out bound what it can do before, and the agent's output
  is its own pipes (:class:`OutputPipes`), so holding them open cannot hold the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

BASE_VARIABLES = ("PATH", "LANG")  # and every LC_*
LAUNCH_FAILED = "agent_launcher: cannot start"  # the launcher's stderr when exec fails (exit 127)
MIB = 1024 * 1024


@dataclass(frozen=True)
class AgentLimits:
    """What one agent process may use; None turns a limit off. Defaults guard a worker, not a workload."""

    address_space_mib: int | None = 16384  # RLIMIT_AS: leaves room for runtimes that reserve (V8, JVMs)
    cpu_seconds: int | None = 600  # RLIMIT_CPU: the agent is SIGKILLed past it
    open_files: int | None = 1024  # RLIMIT_NOFILE
    processes: int | None = 4096  # RLIMIT_NPROC: counts the user's processes (root is exempt)
    output_bytes: int = 4 * MIB  # stdout and stderr, each

    @classmethod
    def of(cls, value: Mapping[str, Any] | None) -> AgentLimits:
        """The limits an options mapping gives (unknown names and non-positive values refused: ValueError)."""
        value = dict(value or {})
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"limits: unknown {unknown}; known: {sorted(known)}")
        for name, number in value.items():
            allowed_off = name != "output_bytes" and number is None
            if not allowed_off and (isinstance(number, bool) or not isinstance(number, int) or number < 1):
                raise ValueError(f"limits.{name} must be a positive integer{' or null' * (name != 'output_bytes')}")
        return cls(**value)

    def as_options(self) -> dict[str, int | None]:
        return asdict(self)

    def rlimits(self) -> dict[str, int]:
        """``resource`` limit names -> values, for the launcher."""
        pairs = {
            "RLIMIT_AS": self.address_space_mib and self.address_space_mib * MIB,
            "RLIMIT_CPU": self.cpu_seconds,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_NPROC": self.processes,
        }
        return {name: value for name, value in pairs.items() if value}


def agent_environment(
    rollout: Mapping[str, str],
    passed: Sequence[str],
    home: FreshHome,
    worker: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The agent's variables: the allow-list, ``HOME``/``TMPDIR`` = ``home``'s folders (as the agent sees them), the
    names ``passed``, and ``rollout``'s (the base URL, key and task, which no worker variable replaces)."""
    allowed = {k: v for k, v in worker.items() if k in BASE_VARIABLES or k.startswith("LC_")}
    named = {name: worker[name] for name in passed if name in worker}
    return {**allowed, **named, "HOME": home.seen_home, "TMPDIR": home.seen_tmp, **rollout}


@dataclass(frozen=True)
class FreshHome:
    """One agent's private ``home`` and ``tmp`` folders on the worker, and the paths the agent sees them at."""

    home: str
    tmp: str
    seen_home: str
    seen_tmp: str


@contextlib.contextmanager
def fresh_home(seen_at: tuple[str, str] | None = None) -> Iterator[FreshHome]:
    """A private folder with ``home/`` and ``tmp/`` for one agent, removed with everything in it afterwards;
    ``seen_at``: where the agent sees the two (a sandbox's fixed paths), default where they are."""
    folder = tempfile.mkdtemp(prefix="rollout-ledger-agent-")
    try:
        home, tmp = (os.path.join(folder, name) for name in ("home", "tmp"))
        for made in (home, tmp):
            os.mkdir(made, 0o700)
        yield FreshHome(home, tmp, *(seen_at or (home, tmp)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def launcher_argv(command: Sequence[str], limits: AgentLimits) -> list[str]:
    """The argv that runs ``command`` under ``limits``, dying with this process (see the launcher)."""
    settings = ",".join(f"{name}={value}" for name, value in limits.rlimits().items())
    return [sys.executable, "-m", "tasks.environments.agent_launcher", str(os.getpid()), settings, "--", *command]


class OutputPipes:
    """Two pipes for an agent's stdout and stderr: their write ends for the child, readers of the read ends.

    They are this process's own, not ``asyncio.subprocess.PIPE``: asyncio's ``Process.wait`` waits
    until its pipes reach EOF, and a reader that stopped at the output bound leaves its transport
    paused, so a killed agent's exit would never be seen. With these, ``wait`` waits for the exit
    only. :meth:`child_started` closes the write ends here (the readers' EOF is then the child's);
    leaving the ``async with`` closes everything.
    """

    def __init__(self) -> None:
        (out_read, out_write), (err_read, err_write) = os.pipe(), os.pipe()
        self.writers = (out_write, err_write)
        self.readers: list[asyncio.StreamReader] = []
        self._unread = [out_read, err_read]  # read ends no transport owns yet
        self._writers_open = True
        self._transports: list[asyncio.BaseTransport] = []

    async def __aenter__(self) -> OutputPipes:
        loop = asyncio.get_running_loop()
        try:
            while self._unread:
                reader = asyncio.StreamReader()
                protocol = asyncio.StreamReaderProtocol(reader)
                file = os.fdopen(self._unread.pop(0), "rb", buffering=0)
                transport, _ = await loop.connect_read_pipe(lambda protocol=protocol: protocol, file)
                self._transports.append(transport)
                self.readers.append(reader)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    def child_started(self) -> None:
        """Close the write ends here (once: a closed descriptor's number is soon another file's)."""
        if self._writers_open:
            self._writers_open = False
            for write_end in self.writers:
                os.close(write_end)

    async def __aexit__(self, *_: object) -> None:
        self.child_started()
        for transport in self._transports:
            transport.close()
        while self._unread:
            os.close(self._unread.pop())


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` (nothing left is fine)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class AgentWatchdog:
    """A process that kills the agents' process groups still running when this process ends, however it ends.

    :meth:`watch` and :meth:`release` tell it each agent's group; it reads them on its stdin, so
    when this process dies the pipe closes and it kills every group it still holds. Started on
    the first agent of an attempt; :meth:`close` ends it, killing what is still listed.
    """

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def release(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def close(self) -> None:
        if self._process is not None:
            with contextlib.suppress(OSError):
                if self._process.stdin is not None:
                    self._process.stdin.close()  # EOF: it kills what it holds and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=10)
            self._process = None

    def _send(self, line: str) -> None:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tasks.environments.agent_watchdog", str(os.getpid())],
                stdin=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C to the worker's group does not end it before the agents
            )
        assert self._process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self._process.stdin.write(line.encode())
            self._process.stdin.flush()
