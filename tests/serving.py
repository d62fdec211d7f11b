"""Running ``rollout-ledger serve`` in a test as a process manager would."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

from tasks.engines.vllm_server.serving.launch import REAP_GRACE_SECONDS, port_taken

# The watchdog's poll, its grace after SIGTERM (SIGKILL after it: vLLM waits on calls in flight), a busy machine.
REAP_TIMEOUT_SECONDS = REAP_GRACE_SECONDS + 15.0


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_reaped(started: Sequence[psutil.Process], port: int, *, killed_at: float) -> float:
    """None of ``started`` (what a SIGKILLed ``serve`` had started) runs and ``port`` is free within
    :data:`REAP_TIMEOUT_SECONDS` of ``killed_at``; the seconds it took."""
    while (
        any(running(p) for p in started) or port_taken("127.0.0.1", port)
    ) and time.monotonic() - killed_at < REAP_TIMEOUT_SECONDS:
        time.sleep(0.1)
    seconds = time.monotonic() - killed_at
    left = [p.pid for p in started if running(p)]
    assert not left, f"processes of a SIGKILLed serve still run after {seconds:.0f} s: {left}"
    assert not port_taken("127.0.0.1", port), f"port {port} still taken {seconds:.0f} s after serve was SIGKILLed"
    return seconds


@contextlib.contextmanager
def serve_process(argv: list[str], home: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """``rollout-ledger serve`` (``argv``) run as a process manager runs it: yields the URL it prints (its stderr in
    ``home/serve.stderr``); then SIGTERM, and it must exit 0 leaving none of the processes it started."""

    with (home / "serve.stderr").open("w") as stderr:
        serve = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        url = serve.stdout.readline().strip() if serve.stdout else ""
        assert url.startswith("http://127.0.0.1:"), f"serve printed no URL:\n{(home / 'serve.stderr').read_text()}"
        started = psutil.Process(serve.pid).children(recursive=True)
        yield url
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=120)
    assert code == 0, f"serve exited {code} on SIGTERM:\n{(home / 'serve.stderr').read_text()[-3000:]}"
    left = [p.pid for p in started if running(p)]
    assert started and not left, f"processes of rollout-ledger serve outlived its SIGTERM: {left}"
