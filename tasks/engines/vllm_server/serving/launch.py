"""``rollout-ledger serve``: start vLLM's own OpenAI-compatible server for a model folder, ready for ``vllm_server``.

A thin launcher, not a second server: it runs vLLM's API server entry point with the flags this
project's capture needs (``--logprobs-mode processed_logprobs``, the token-in/token-out endpoint
``--enable-scale-out``, the RL endpoints through ``VLLM_SERVER_DEV_MODE=1``) and the same
defaults the in-process engine takes: the launcher takes any :class:`LaunchOptions`, and the vLLM
engine's :class:`~tasks.engines.vllm.options.VllmOptions` is one (float32, eager, whole prefills
on CPU), so this package never imports the other engine. Every server has an API key, and every
route but ``/health`` requires it: vLLM's ``--middleware`` hook installs :class:`~.auth.RequireKey`
(vLLM's own key check leaves the RL endpoints and ``/metrics`` open). The key travels in
``VLLM_API_KEY``, never on a command line (:mod:`.keys` makes one). Readiness is ``/health``
answering 200, polled with httpx.

The server runs in its own process group (a terminal's Ctrl-C reaches only this process, which
stops it in order); :meth:`VllmServer.stop` ends the whole group (SIGTERM, then SIGKILL after a
grace period) and returns only when no process of it is left. The server lives no longer than the
process that launched it: a :class:`~tasks.engines.reaper.Reaper` watchdog, started before it and
in a session of its own, stops the server and every process below it once the launcher has ended
without :meth:`VllmServer.stop` (SIGKILL of the launcher or of its process group included), with
a short grace between SIGTERM and SIGKILL (:func:`reap_grace`): in vLLM's default abort mode the
API server stops its engine within a second of SIGTERM, then waits without end for the connections
of calls in flight, which no engine will answer now; their clients hear nothing until it has ended.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import psutil

from tasks.engines.reaper import GRACE_SECONDS, Reaper
from tasks.engines.vllm_server.serving.keys import KEY_ENV, MIDDLEWARE_PATH
from tasks.errors import EngineError

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
READY_TIMEOUT_SECONDS = 600.0
STOP_GRACE_SECONDS = 30.0
# The watchdog's grace once the launcher is gone (reap_grace): the in-process engine's watchdog's, which
# stops the same engine core and workers; vLLM's drain time is added where one is configured.
REAP_GRACE_SECONDS = GRACE_SECONDS
LAUNCH_SCAN_SECONDS = 0.01  # how often the watchdog looks for the server while it is being started
LOG_TAIL_CHARS = 3000
HEALTH_TIMEOUT_SECONDS = 2.0  # one /health request while waiting for the server


class LaunchOptions(Protocol):
    """What the launcher asks of vLLM's options (:class:`tasks.engines.vllm.options.VllmOptions` answers)."""

    def engine_args(self, model_path: Path, *, on_cpu: bool) -> dict[str, Any]:
        """vLLM's engine arguments for serving ``model_path`` (each becomes a ``--flag``)."""
        ...

    def cpu_env_defaults(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The vLLM-CPU environment settings ``environ`` lacks."""
        ...


def server_argv(model_folder: Path, options: LaunchOptions, *, host: str, port: int, on_cpu: bool) -> list[str]:
    """The command line of a vLLM server for ``model_folder`` with ``options`` (no secret in it)."""
    argv = [sys.executable, "-m", SERVER_MODULE, "--host", host, "--port", str(port), "--enable-scale-out"]
    argv += ["--middleware", MIDDLEWARE_PATH]
    for key, value in options.engine_args(model_folder, on_cpu=on_cpu).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append(f"--no-{key.replace('_', '-')}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def reap_grace(engine_args: Mapping[str, Any]) -> float:
    """How long the watchdog lets a server launched with ``engine_args`` stop on SIGTERM before it SIGKILLs what is
    left, once the launcher has ended: :data:`REAP_GRACE_SECONDS` after vLLM's own ``shutdown_timeout`` (the time a
    drain-mode shutdown lets calls in flight finish; 0, vLLM's default, aborts them at once)."""
    return REAP_GRACE_SECONDS + float(engine_args.get("shutdown_timeout") or 0)


def server_env(options: LaunchOptions, *, api_key: str, on_cpu: bool) -> dict[str, str]:
    """The server's environment: this one, the RL endpoints on, vLLM-CPU defaults where unset, the key."""
    if not api_key:
        raise ValueError("a vLLM server of rollout-ledger serve needs an API key")
    env = dict(os.environ) | {"VLLM_SERVER_DEV_MODE": "1", KEY_ENV: api_key}
    if on_cpu:
        env |= options.cpu_env_defaults(env)
    return env


@dataclass
class VllmServer:
    """A ``vllm serve`` this process started: its process group leader, URL, log file and watchdog."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    reaper: Reaper

    @classmethod
    def start(
        cls,
        model_folder: Path,
        options: LaunchOptions,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str,
        log_path: Path,
    ) -> VllmServer:
        """Start the server in its own process group, its output to ``log_path``; returns at once.

        Every route but ``/health`` requires ``api_key`` (an empty key is refused)."""
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        return cls.launch(
            server_argv(model_folder, options, host=host, port=port, on_cpu=on_cpu),
            server_env(options, api_key=api_key, on_cpu=on_cpu),
            url=f"http://{host}:{port}",
            log_path=log_path,
            grace=reap_grace(options.engine_args(model_folder, on_cpu=on_cpu)),
        )

    @classmethod
    def launch(
        cls, argv: list[str], env: dict[str, str], *, url: str, log_path: Path, grace: float = REAP_GRACE_SECONDS
    ) -> VllmServer:
        """Run ``argv`` with ``env`` in its own process group, its output to ``log_path``; returns at once.

        Its watchdog is up before it starts: if this process ends before :meth:`stop`, however it
        ends, the watchdog stops the server's processes (SIGTERM, SIGKILL after ``grace`` s)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        reaper = Reaper.start(grace=grace, scan_seconds=LAUNCH_SCAN_SECONDS, resource_tracker_first=False)
        try:
            with open(log_path, "ab") as log:
                process = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except BaseException:
            reaper.reap()
            raise
        reaper.started()
        return cls(process, url, log_path, reaper)

    def wait_ready(
        self, *, timeout: float = READY_TIMEOUT_SECONDS, on_wait: Callable[[float], Any] | None = None
    ) -> None:
        """Block until ``/health`` answers 200; an :class:`EngineError` with the log's tail if it exits first."""
        started = time.monotonic()
        while True:
            if self.process.poll() is not None:
                raise EngineError(
                    f"vLLM server exited with {self.process.returncode} before it was ready; "
                    f"its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            if _healthy(self.url):
                return
            waited = time.monotonic() - started
            if waited > timeout:
                self.stop()
                raise EngineError(f"vLLM server not ready after {timeout:.0f} s; see {self.log_path}")
            if on_wait is not None:
                on_wait(waited)
            time.sleep(0.5)

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``grace`` s, then end the watchdog;
        idempotent."""
        group = self.process.pid
        members = group_members(group)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        _, alive = psutil.wait_procs(members, timeout=grace)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(alive, timeout=grace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace)
        self.reaper.stop()

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (for a server started next)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def port_taken(host: str, port: int) -> bool:
    """Whether a socket already holds ``port`` on ``host``: the bind vLLM's server makes (``SO_REUSEADDR``, so
    connections closing in TIME_WAIT do not count) fails with "address in use"."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def group_members(group: int) -> list[psutil.Process]:
    """Processes whose process group is ``group`` (the server and every process it started)."""
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) == group:
                members.append(process)
    return members


def _healthy(url: str) -> bool:
    """Whether the server at ``url`` answers ``GET /health`` with 200 now."""
    try:
        return httpx.get(f"{url}/health", timeout=HEALTH_TIMEOUT_SECONDS).status_code == 200
    except httpx.HTTPError:
        return False


def serve_until_stopped(server: VllmServer) -> int | None:
    """Wait until this process gets SIGTERM or SIGINT (then stop the server: ``None``) or the server exits
    on its own (its exit code)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.is_set() and server.process.poll() is None:
            stop.wait(0.5)
    finally:
        exited = server.process.poll()
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exited
