"""A SIGKILLed ``rollout-ledger serve`` takes its vLLM server with it, and a new ``serve`` takes the port at once.

Three real serves of the bundled model, one after the other on one port (30-80 s each to start on
CPU), each started as a shell starts a job (a process group of its own) with a key of its own.
The first is SIGKILLed alone, the second with its whole process group, both while serving. After
each kill, within :data:`REAP_TIMEOUT_SECONDS`, no process the serve had started is left (vLLM's API
server, engine core and worker, the watchdog) and the port is free; the next serve on the same port
starts and answers. The last is stopped with SIGTERM, in order, as a process manager stops it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from tasks.engines.vllm_server.engine import GENERATE_PATH
from tasks.engines.vllm_server.serving.launch import free_port, port_taken
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
from tests.serving import serve_process

# No xdist group: its serves are its own (not the test run's shared server), so any free worker runs it.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

REAP_TIMEOUT_SECONDS = 60.0  # the watchdog's poll, vLLM's shutdown on SIGTERM (SIGKILL after 30 s), a busy machine


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def answers(url: str, key_file: Path) -> None:
    """The server at ``url`` lists its model and generates with the key in ``key_file``."""
    headers = {"Authorization": f"Bearer {key_file.read_text().strip()}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        (model,) = client.get("/v1/models").raise_for_status().json()["data"]
        body = {"model": model["id"], "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "seed": 1}}
        answer = client.post(GENERATE_PATH, json=body | {"return_token_ids": True}).raise_for_status().json()
    assert len(answer["choices"][0]["token_ids"]) == 2


def kill_serving(argv: list[str], home: Path, env: dict[str, str], kill: Callable[[subprocess.Popen], None]) -> float:
    """Start ``serve`` in a process group of its own, check it answers, ``kill`` it; the seconds from the kill
    until none of the processes it had started is left and its port is free."""
    with (home / "serve.stderr").open("w") as stderr:
        serve = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, start_new_session=True
        )
    try:
        url = serve.stdout.readline().strip() if serve.stdout else ""
        assert url.startswith("http://127.0.0.1:"), f"serve printed no URL:\n{(home / 'serve.stderr').read_text()}"
        port = int(url.rpartition(":")[2])
        answers(url, home / "serve" / f"port-{port}.key")
        started = psutil.Process(serve.pid).children(recursive=True)
        groups = {os.getpgid(process.pid) for process in started}
        assert len(started) >= 3 and serve.pid not in groups, started  # the watchdog, vLLM's API server, engine core
    finally:
        killed_at = time.monotonic()
        kill(serve)
        serve.wait(timeout=30)
    while (
        any(running(p) for p in started) or port_taken("127.0.0.1", port)
    ) and time.monotonic() - killed_at < REAP_TIMEOUT_SECONDS:
        time.sleep(0.1)
    seconds = time.monotonic() - killed_at
    left = [p.pid for p in started if running(p)]
    assert not left, f"processes of a SIGKILLed serve still run after {seconds:.0f} s: {left}"
    assert not port_taken("127.0.0.1", port), f"port {port} still taken {seconds:.0f} s after serve was SIGKILLed"
    return seconds


def test_a_sigkilled_serve_leaves_no_server_and_a_new_serve_takes_its_port(tmp_path: Path) -> None:
    folder = resolve_model_reference(BUNDLED_REFERENCE)  # in the user's cache: the serves' home has no model
    port = free_port()
    argv = [sys.executable, "-m", "tasks.cli", "serve", "--port", str(port), "--model", str(folder)]
    argv += ["--engine-option", "max_model_len=2048"]
    env = dict(os.environ, ROLLOUT_LEDGER_HOME=str(tmp_path))

    alone = kill_serving(argv, tmp_path, env, lambda serve: serve.kill())
    group = kill_serving(argv, tmp_path, env, lambda serve: os.killpg(serve.pid, signal.SIGKILL))
    print(f"nothing left and port {port} free {alone:.1f} s after SIGKILL of serve, {group:.1f} s of its group")
    with serve_process(argv, tmp_path, env) as url:  # SIGTERM at the end: it must stop in order, leaving nothing
        assert url == f"http://127.0.0.1:{port}"
        answers(url, tmp_path / "serve" / f"port-{port}.key")
