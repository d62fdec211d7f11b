"""A server of :class:`VllmServer` ends with the process that launched it, however that process ends.

No vLLM here: the "server" is a small program that listens on a port and starts a child of its own
(standing in for vLLM's API server and its engine core), launched through :meth:`VllmServer.launch`
by a launcher process (standing in for ``rollout-ledger serve``), which the test then kills with
SIGKILL, alone or with its whole process group. The real server:
``tests/generation/test_server_failover_e2e.py`` (serve SIGKILLed alone, and with its group).
Readiness (``/health`` polled with httpx) is shown by a stand-in that answers it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tasks.engines.vllm_server.serving.launch import VllmServer, free_port, port_taken
from tasks.errors import EngineError
from tests.serving import LAUNCHER, assert_reaped, running

SERVER = """
import socket, subprocess, sys, time
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(600)
"""
HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def server_tree(server_pid: int, deadline: float) -> list[psutil.Process]:
    """The fake server and its child, once the child is up (the server starts it after binding its port)."""
    server = psutil.Process(server_pid)
    while time.monotonic() < deadline:
        children = server.children(recursive=True)
        if children:
            return [server, *children]
        time.sleep(0.05)
    raise AssertionError("the fake server started no child")


def start_launcher(port: int, tmp_path: Path, *then: str) -> tuple[subprocess.Popen, dict]:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(port), str(tmp_path / "server.log"), SERVER, *then],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        start_new_session=True,  # as a shell starts a job: the launcher leads a process group of its own
    )
    return launcher, json.loads(launcher.stdout.readline())


def catches_sigterm(pid: int) -> bool:
    """Whether ``pid`` has a handler for SIGTERM (``SigCgt`` in ``/proc``): :func:`serve_until_stopped` is waiting."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


@pytest.mark.parametrize("kill", ["process", "process group"])
def test_a_sigkilled_launcher_leaves_no_server_process_and_frees_the_port(kill: str, tmp_path: Path) -> None:
    port = free_port()
    launcher, pids = start_launcher(port, tmp_path)
    tree = server_tree(pids["server"], time.monotonic() + 30)
    watchdog = psutil.Process(pids["watchdog"])
    assert port_taken("127.0.0.1", port)
    assert os.getpgid(pids["server"]) != launcher.pid and os.getpgid(pids["watchdog"]) != launcher.pid
    killed_at = time.monotonic()
    if kill == "process":
        launcher.kill()
    else:
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    seconds = assert_reaped([*tree, watchdog], port, killed_at=killed_at)
    print(f"SIGKILL of the launcher's {kill}: nothing left after {seconds:.2f} s")


@pytest.mark.parametrize(
    ("sent", "to_group"), [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm"]
)
def test_ctrl_c_and_sigterm_stop_the_server_in_order(sent: signal.Signals, to_group: bool, tmp_path: Path) -> None:
    """Ctrl-C reaches the launcher's process group only (the server has its own); the launcher stops the server."""
    port = free_port()
    launcher, pids = start_launcher(port, tmp_path, "serve-until-stopped")
    tree = server_tree(pids["server"], time.monotonic() + 30)
    watchdog = psutil.Process(pids["watchdog"])
    deadline = time.monotonic() + 30
    while not catches_sigterm(launcher.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # serve_until_stopped sets SIGINT's handler right after SIGTERM's
    if to_group:
        os.killpg(launcher.pid, sent)
    else:
        launcher.send_signal(sent)
    assert launcher.wait(timeout=60) == 0
    assert [p.pid for p in [*tree, watchdog] if running(p)] == []
    assert not port_taken("127.0.0.1", port)


def test_stop_ends_the_server_its_children_and_the_watchdog(tmp_path: Path) -> None:
    port = free_port()
    server = VllmServer.launch(
        [sys.executable, "-c", SERVER, str(port)], {}, url=f"http://127.0.0.1:{port}", log_path=tmp_path / "log"
    )
    tree = server_tree(server.process.pid, time.monotonic() + 30)
    watchdog = psutil.Process(server.reaper.pid)
    assert running(watchdog)
    server.stop()
    assert [p.pid for p in [*tree, watchdog] if running(p)] == []
    assert not port_taken("127.0.0.1", port)
    server.stop()  # idempotent


def test_wait_ready_returns_once_health_answers_200_and_names_the_log_of_a_server_that_exits(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = VllmServer.launch([sys.executable, "-c", HEALTH_SERVER, str(port)], {}, url=url, log_path=tmp_path / "up")
    try:
        server.wait_ready(timeout=30)
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        server.stop()
    exits = [sys.executable, "-c", "import sys; print('no model here', flush=True); sys.exit(3)"]
    dead = VllmServer.launch(exits, {}, url=url, log_path=tmp_path / "dead")
    with pytest.raises(EngineError, match=r"(?s)exited with 3 before it was ready; .*no model here"):
        dead.wait_ready(timeout=30)
    dead.stop()


def test_a_port_is_taken_while_a_socket_listens_on_it_not_by_connections_closing_in_time_wait() -> None:
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's server binds
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert port_taken("127.0.0.1", port) and port_taken("localhost", port)
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its end waits in TIME_WAIT on the port
    assert not port_taken("127.0.0.1", port)


def test_serve_on_a_port_in_use_is_refused_before_a_new_key_replaces_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tasks.cli.main import main

    monkeypatch.setenv("ROLLOUT_LEDGER_HOME", str(tmp_path))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"port {port} on 127.0.0.1 is in use: stop the server that holds it" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no key made, no model resolved, no log
