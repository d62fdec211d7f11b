"""Running ``rollout-ledger serve`` in a test as a process manager would, or a stand-in for it (:data:`LAUNCHER`)."""

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
# A stand-in for ``rollout-ledger serve`` without vLLM: ``python -c LAUNCHER PORT LOG SERVER [serve-until-stopped]``
# launches ``python -c SERVER PORT`` through VllmServer.launch (its output in LOG), prints the pids of the server and
# its watchdog as JSON, then sleeps, or with ``serve-until-stopped`` waits for SIGTERM or SIGINT as serve does.
LAUNCHER = """
import json, sys, time
from pathlib import Path
from tasks.engines.vllm_server.serving.launch import VllmServer, serve_until_stopped
port, log = sys.argv[1], Path(sys.argv[2])
server = VllmServer.launch([sys.executable, "-c", sys.argv[3], port], {}, url="http://127.0.0.1:" + port, log_path=log)
print(json.dumps({"server": server.process.pid, "watchdog": server.reaper.pid}), flush=True)
if sys.argv[4:] == ["serve-until-stopped"]:
    sys.exit(0 if serve_until_stopped(server) is None else 1)
time.sleep(600)
"""


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


def name_weight_version(url: str, key: str, version: int) -> None:
    """What a refit's last step does: the server at ``url`` names its weights ``version``."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    httpx.post(f"{url}/update_weight_version", json={"new_version": str(version)}, headers=headers).raise_for_status()
