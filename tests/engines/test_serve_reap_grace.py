"""Once ``serve`` is gone, its watchdog gives the server a short grace after SIGTERM, then SIGKILLs what is left.

vLLM's API server, sent SIGTERM with calls in flight, stops its engine at once (abort mode, vLLM's
default) and then waits without end for those calls' connections to close; its clients hear
nothing until it is gone. The stand-in here does the same: on SIGTERM it closes its listening
socket, says so in its log, and goes on running, as does a child of its own that ignores SIGTERM
(as multiprocessing's resource tracker does). Launched through :meth:`VllmServer.launch` by a
launcher (standing in for ``rollout-ledger serve``) that the test SIGKILLs, it must get SIGTERM,
then be gone within the watchdog's grace (:func:`reap_grace`), not the orderly stop's 30 s. The
real server: ``tests/generation/test_server_failover_e2e.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tasks.engines.vllm.options import VllmOptions
from tasks.engines.vllm_server.serving.launch import (
    REAP_GRACE_SECONDS,
    STOP_GRACE_SECONDS,
    free_port,
    port_taken,
    reap_grace,
)
from tests.serving import LAUNCHER, assert_reaped

REPO = Path(__file__).resolve().parents[2]
SLACK_SECONDS = 10.0  # the watchdog's poll, its SIGKILL rounds, a busy machine
STUCK_SERVER = """
import signal, socket, subprocess, sys, time
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen()
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", deaf])
def on_sigterm(*_):
    listener.close()
    print("SIGTERM: waiting for connections to close", flush=True)
signal.signal(signal.SIGTERM, on_sigterm)
print("child", child.pid, flush=True)
while True:
    time.sleep(600)
"""


def test_a_server_stuck_after_sigterm_is_gone_within_the_reap_grace_once_serve_is_sigkilled(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(port), str(log), STUCK_SERVER],
        stdout=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        start_new_session=True,
    )
    pids = json.loads(launcher.stdout.readline() if launcher.stdout else "{}")
    deadline = time.monotonic() + 30
    while "child" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    server = psutil.Process(pids["server"])
    tree = [server, *server.children(recursive=True)]
    assert len(tree) == 2 and port_taken("127.0.0.1", port)
    everything = [*tree, psutil.Process(pids["watchdog"])]

    killed_at = time.monotonic()
    launcher.kill()
    launcher.wait()
    seconds = assert_reaped(everything, port, killed_at=killed_at)
    print(f"a server stuck after SIGTERM: gone {seconds:.1f} s after its launcher's SIGKILL")

    assert "SIGTERM: waiting for connections to close" in log.read_text()  # SIGTERM came first
    assert REAP_GRACE_SECONDS - 0.5 <= seconds <= REAP_GRACE_SECONDS + SLACK_SECONDS < STOP_GRACE_SECONDS


def test_the_reap_grace_waits_out_a_drain_mode_shutdown_too(tmp_path: Path) -> None:
    """vLLM's ``shutdown_timeout`` (engine_kwargs) lets calls in flight finish for that long: the grace adds it."""
    assert reap_grace(VllmOptions().engine_args(tmp_path, on_cpu=False)) == REAP_GRACE_SECONDS
    drain = VllmOptions(engine_kwargs={"shutdown_timeout": 20})
    assert reap_grace(drain.engine_args(tmp_path, on_cpu=False)) == REAP_GRACE_SECONDS + 20
