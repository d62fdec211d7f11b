"""Agent command processes, for real: what they see, what they may use, and that none outlives its worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tasks.engines.vllm_server.options import API_KEY_ENV
from tasks.environments import agents
from tasks.environments.agent_process import AgentLimits
from tasks.environments.agent_sandbox import ISOLATION_SANDBOX, ISOLATIONS, SANDBOX_HOME, SANDBOX_TMP
from tasks.environments.agents import AgentCommand, AgentDoor, AgentFailure
from tasks.storage.options import STORAGE_OPTIONS_VARIABLE

DOOR = AgentDoor("http://127.0.0.1:9/rollouts/r/v1", "rollout-key")
# Secrets a worker holds; none reaches an agent unless its entry names it.
PLANTED = {
    "AWS_SECRET_ACCESS_KEY": "planted-aws-secret-0001",
    "AWS_SESSION_TOKEN": "planted-aws-session-0002",
    "AIRFLOW__CORE__FERNET_KEY": "planted-fernet-key-0003",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://u:planted-db-pass-0004@db/airflow",
    "HF_TOKEN": "planted-hf-token-0005",
    STORAGE_OPTIONS_VARIABLE: '{"secret": "planted-storage-0006"}',
    API_KEY_ENV: "planted-server-key-0007",
    "OPENAI_API_KEY": "planted-openai-key-0008",
    "GOOGLE_APPLICATION_CREDENTIALS": "/planted/gcp-0009.json",
    "AZURE_CLIENT_SECRET": "planted-azure-0010",
}
DUMP_ENV = "import json, os; print(json.dumps({'reward': 1, 'env': dict(os.environ)}))"


@pytest.fixture
def tasks_file(tmp_path: Path) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"i": 0}\n')
    return path


def run(agent: AgentCommand, bound_s: float = 120.0):
    """The agent's rollout, bounded: one the worker cannot end fails the test in ``bound_s``."""
    try:
        return asyncio.run(asyncio.wait_for(agent.run(DOOR, {"i": 0}), bound_s))
    finally:
        agent.close()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_an_agent_sees_only_the_allow_list_and_the_names_its_entry_passes(tasks_file, tmp_path, monkeypatch, isolation):
    homes = tmp_path / "homes"  # where the worker makes the agents' fresh homes
    homes.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(homes))
    for name, value in {**PLANTED, "TOOL_TOKEN": "passed-tool-token", "LC_ALL": "C.UTF-8"}.items():
        monkeypatch.setenv(name, value)
    command = [sys.executable, "-c", DUMP_ENV]
    agent = AgentCommand(command=command, tasks=str(tasks_file), env=["TOOL_TOKEN"], isolation=isolation)
    seen = run(agent).info["env"]
    assert not set(PLANTED.values()) & set(seen.values()) - {DOOR.api_key}
    assert seen["OPENAI_API_KEY"] == "[redacted]"  # the rollout's key: kept out of the info like a passed secret
    assert seen["OPENAI_BASE_URL"] == DOOR.base_url
    assert (
        json.loads(seen["ROLLOUT_LEDGER_TASK"]) == {"i": 0} and seen["TOOL_TOKEN"] == "[redacted]"
    )  # passed, kept out of the info
    assert seen["PATH"] == os.environ["PATH"] and seen["LC_ALL"] == "C.UTF-8"
    allowed = {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "TOOL_TOKEN", "LC_CTYPE", "PWD"}
    assert set(seen) - {"OPENAI_API_KEY", "OPENAI_BASE_URL", "ROLLOUT_LEDGER_TASK"} <= allowed
    if isolation == ISOLATION_SANDBOX:  # the rollout's private folders, at the sandbox's fixed paths
        assert (seen["HOME"], seen["TMPDIR"]) == (SANDBOX_HOME, SANDBOX_TMP)
    else:
        home = Path(seen["HOME"])
        assert home.parent == Path(seen["TMPDIR"]).parent and home.parent.parent == homes
    assert not list(homes.iterdir()), "the agent's fresh home outlived its rollout"


def test_a_passed_secret_the_agent_prints_is_kept_out_of_the_failure(tasks_file, monkeypatch):
    monkeypatch.setenv("TOOL_TOKEN", "passed-tool-token")
    script = "import os, sys; sys.stderr.write('token=' + os.environ['TOOL_TOKEN']); sys.exit(3)"
    agent = AgentCommand(command=[sys.executable, "-c", script], tasks=str(tasks_file), env=["TOOL_TOKEN"])
    with pytest.raises(AgentFailure) as failed:
        run(agent)
    assert failed.value.reason == "agent_exit" and "passed-tool-token" not in failed.value.detail
    assert "token=[redacted]" in failed.value.detail


@pytest.mark.parametrize("attempt", range(4))
def test_output_past_the_bound_fails_the_rollout_without_holding_it(tasks_file, attempt):
    # Repeated: with asyncio's own pipes, about one flood in three left the reader's transport
    # paused at the bound, so the killed agent's exit was never seen and the rollout hung.
    script = "import sys\nfor _ in range(64): sys.stdout.write('x' * 65536)\nprint('{\"reward\": 1}')"
    agent = AgentCommand(
        command=[sys.executable, "-c", script], tasks=str(tasks_file), limits={"output_bytes": 1024 * 1024}
    )
    with pytest.raises(AgentFailure) as failed:
        run(agent, bound_s=30)
    assert failed.value.reason == "agent_output_limit" and "stdout" in failed.value.detail


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_process_that_left_the_group_cannot_hold_the_rollout_open(tasks_file, monkeypatch, isolation):
    monkeypatch.setattr(agents, "OUTPUT_GRACE_S", 1.0)
    token = f"escapee-{uuid.uuid4().hex}"  # the child keeps the agent's stdout open from a session of its own
    escape = f"import os, sys, time; os.setsid(); open(sys.argv[1], 'w').close(); time.sleep(20)  # {token}"
    script = textwrap.dedent(
        f"""
        import os, subprocess, sys, tempfile, time
        left = os.path.join(tempfile.gettempdir(), 'left')
        subprocess.Popen([sys.executable, '-c', {escape!r}, left])
        while not os.path.exists(left):
            time.sleep(0.05)
        print('{{"reward": 1}}')
        """
    )
    agent = AgentCommand(command=[sys.executable, "-c", script], tasks=str(tasks_file), isolation=isolation)
    started = time.monotonic()
    if isolation == ISOLATION_SANDBOX:  # the sandbox's PID namespace ends with the agent: so does the escapee
        assert run(agent, bound_s=15).reward == 1
        assert _ended(_with_token(token), timeout=5)
    else:
        with pytest.raises(AgentFailure) as failed:
            run(agent, bound_s=15)
        assert failed.value.reason == "agent_error" and "left the agent's group" in failed.value.detail
    assert time.monotonic() - started < 10


def test_the_limits_are_set_in_the_agent_process(tasks_file):
    script = textwrap.dedent(
        """
        import json, resource
        names = ["RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NOFILE", "RLIMIT_NPROC"]
        print(json.dumps({"reward": 0, **{n: resource.getrlimit(getattr(resource, n)) for n in names}}))
        """
    )
    limits = {"address_space_mib": 2048, "cpu_seconds": 30, "open_files": 64, "processes": 512}
    info = run(AgentCommand(command=[sys.executable, "-c", script], tasks=str(tasks_file), limits=limits)).info
    assert info == {
        "RLIMIT_AS": [2048 << 20] * 2,
        "RLIMIT_CPU": [30, 30],
        "RLIMIT_NOFILE": [64, 64],
        "RLIMIT_NPROC": [512, 512],
    }
    spin = AgentCommand(
        command=[sys.executable, "-c", "while True: pass"], tasks=str(tasks_file), limits={"cpu_seconds": 1}
    )
    with pytest.raises(AgentFailure) as failed:
        run(spin)
    assert failed.value.reason == "agent_exit"


@pytest.mark.parametrize("limits", [{"cpu_seconds": 0}, {"output_bytes": None}, {"memory": 1}, {"open_files": 1.5}])
def test_bad_limits_are_refused(tasks_file, limits):
    with pytest.raises(ValueError, match="limits"):
        AgentCommand(command=["true"], tasks=str(tasks_file), limits=limits)
    assert AgentLimits.of({"processes": None}).rlimits().keys() == {"RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NOFILE"}


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_what_an_agent_leaves_running_ends_with_its_episode(tasks_file, isolation):
    token = f"left-running-{uuid.uuid4().hex}"
    script = (
        "import subprocess, sys; "
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {token}']); "
        "print('{\"reward\": 1}')"
    )
    command = [sys.executable, "-c", script]
    assert run(AgentCommand(command=command, tasks=str(tasks_file), isolation=isolation)).reward == 1
    assert _ended(_with_token(token), timeout=5)


WORKER = """
import asyncio, sys
from tasks.environments.agents import AgentCommand, AgentDoor
script = (
    "import os, subprocess, sys, time; "
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "open(sys.argv[1], 'w').close(); time.sleep(120)"
)
binds = [{"path": sys.argv[3], "writable": True}] if sys.argv[4] == "sandbox" else []
agent = AgentCommand(
    command=[sys.executable, "-c", script, sys.argv[1]], tasks=sys.argv[2], timeout_s=300, isolation=sys.argv[4],
    binds=binds,
)
asyncio.run(agent.run(AgentDoor("http://127.0.0.1:9/v1", "k"), {"i": 0}))
"""


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_sigkilled_worker_leaves_no_agent_process(tasks_file, tmp_path, isolation):
    started = tmp_path / "shared" / "started"
    started.parent.mkdir()
    argv = [sys.executable, "-c", WORKER, str(started), str(tasks_file), str(started.parent), isolation]
    worker = subprocess.Popen(argv, cwd=Path.cwd())
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    agents = [child.pid for child in psutil.Process(worker.pid).children(recursive=True)]
    assert started.exists() and len(agents) >= 2  # the agent and its child (and, sandboxed, bwrap)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    assert _ended(agents, timeout=10), "an agent process outlived its SIGKILLed worker"


def _with_token(token: str) -> list[int]:
    """The processes whose command line holds ``token``."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(token in part for part in process.info["cmdline"] or ()):
            found.append(process.pid)
    return found


def _ended(pids: list[int], *, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                alive += [pid] if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE else []
        if not alive:
            return True
        time.sleep(0.1)
    return False
