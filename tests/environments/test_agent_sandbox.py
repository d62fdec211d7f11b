"""The OS sandbox of agent commands (bubblewrap), for real: what an agent that goes looking finds of its worker.

Each attack runs an agent inside a real worker process (a child Python that holds planted secrets in
its initial environment, its home and its Airflow home) under both isolations: sandboxed, the agent
finds nothing; as a plain process (``isolation: process``), the same agent finds the secrets, so the
attack is real and the sandbox is what stops it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tasks.environments.agent_sandbox import ISOLATION_PROCESS, ISOLATION_SANDBOX, SANDBOX_UID, Sandbox
from tasks.environments.agents import AgentCommand
from tasks.errors import AgentCommandError

PLANTED = {
    "AWS_SECRET_ACCESS_KEY": "planted-aws-secret-s01",
    "AIRFLOW__CORE__FERNET_KEY": "planted-fernet-s02",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://u:planted-db-s03@db/airflow",
    "ROLLOUT_LEDGER_STORAGE_OPTIONS": '{"secret": "planted-storage-s04"}',
    "ROLLOUT_LEDGER_SERVER_API_KEY": "planted-server-key-s05",
}
IN_FILES = {"aws": "planted-aws-file-s06", "airflow": "planted-airflow-cfg-s07", "key": "planted-key-file-s08"}
# Reads every /proc/*/environ and /proc/*/cmdline it can see and every credential file its task names (as tool code
# could), calls the worker's loopback service with its own key, and reports all of it.
SNOOP = textwrap.dedent(
    """
    import glob, json, os, sys, urllib.request
    seen = {}
    for name in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
        try:
            seen[name] = open(name, "rb").read().decode("latin-1")
        except OSError as error:
            seen[name] = f"unreadable: {error.strerror}"
    for name in json.loads(os.environ["ROLLOUT_LEDGER_TASK"])["files"]:
        try:
            seen[name] = open(name).read()
        except OSError as error:
            seen[name] = f"unreadable: {error.strerror}"
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"], headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
    )
    seen["call"] = urllib.request.urlopen(request, timeout=10).read().decode()
    seen["uid"], seen["fds"] = os.getuid(), sorted(os.listdir("/proc/self/fd"))
    seen["status"] = open("/proc/self/status").read()
    print(json.dumps({"reward": 1, "seen": seen}))
    """
)
# A worker: a loopback service that answers a rollout's key, and two rollouts of the snooping agent at once.
WORKER = textwrap.dedent(
    """
    import asyncio, http.server, json, sys, threading
    from tasks.environments.agents import AgentCommand, AgentDoor

    class Door(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.headers.get("Authorization", "").startswith("Bearer rollout-key-")
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(b"answered" if ok else b"refused")
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Door)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    agent, tasks, files = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    agent = AgentCommand(tasks=tasks, **agent)

    async def both():
        doors = [AgentDoor(url, f"rollout-key-{i}-0123456789") for i in range(2)]
        return await asyncio.gather(*(agent.run(door, {"i": i, "files": files}) for i, door in enumerate(doors)))

    try:
        print(json.dumps([result.info["seen"] for result in asyncio.run(both())]))
    finally:
        agent.close()
    """
)


@pytest.fixture
def tasks_file(tmp_path: Path) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"i": 0}\n')
    return path


def run_worker(tmp_path: Path, tasks_file: Path, agent: dict, *, prefix: tuple[str, ...] = ()) -> list[dict]:
    """The two rollouts' findings, from a worker holding the planted secrets in its environment, home and files."""
    home, airflow_home = tmp_path / "worker-home", tmp_path / "airflow"
    (home / ".aws").mkdir(parents=True)
    airflow_home.mkdir()
    (home / ".aws" / "credentials").write_text(f"[default]\naws_secret_access_key = {IN_FILES['aws']}\n")
    (airflow_home / "airflow.cfg").write_text(f"[core]\nfernet_key = {IN_FILES['airflow']}\n")
    (home / "server.key").write_text(IN_FILES["key"])
    files = [str(home / ".aws" / "credentials"), str(airflow_home / "airflow.cfg"), str(home / "server.key")]
    env = {**os.environ, **PLANTED, "HOME": str(home), "AIRFLOW_HOME": str(airflow_home)}
    command = {"command": [sys.executable, "-c", SNOOP], **agent}
    done = subprocess.run(
        [*prefix, sys.executable, "-c", WORKER, json.dumps(command), str(tasks_file), json.dumps(files)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def secrets_found(seen: dict) -> set[str]:
    """The planted secrets (whole values) that appear anywhere in what the agent found."""
    text = json.dumps(seen)
    return {secret for secret in [*PLANTED.values(), *IN_FILES.values()] if json.dumps(secret)[1:-1] in text}


def test_a_sandboxed_agent_finds_no_worker_secret_in_proc_or_files_and_its_own_call_works(tmp_path, tasks_file):
    first, second = run_worker(tmp_path, tasks_file, {})
    for other, seen in ((1, first), (0, second)):
        assert not secrets_found(seen)
        assert f"rollout-key-{other}-" not in json.dumps(seen), "an agent read its sibling's rollout key"
        environs = [name for name in seen if name.endswith("/environ")]
        assert sorted(environs) == ["/proc/1/environ", "/proc/2/environ"]  # bwrap (its environment is the agent's)
        assert all(seen[f].startswith("unreadable") for f in seen if f.startswith(str(tmp_path)))
        assert seen["call"] == "answered"  # the worker's loopback still answers it
        assert seen["uid"] == SANDBOX_UID and seen["fds"] == ["0", "1", "2", "3"]  # 3: listdir's own
        status = dict(line.split(":\t") for line in seen["status"].splitlines() if ":\t" in line)
        assert status["CapEff"] == status["CapPrm"] == "0000000000000000" and status["NoNewPrivs"] == "1"
        assert "OPENAI_API_KEY=[redacted]" in seen["/proc/1/environ"]  # only its own (kept out of its output)


def test_the_same_agent_as_a_plain_process_finds_the_worker_secrets(tmp_path, tasks_file):
    """The control: without the sandbox, /proc and the worker's files give the secrets away."""
    first, second = run_worker(tmp_path, tasks_file, {"isolation": ISOLATION_PROCESS})
    for seen in (first, second):
        assert secrets_found(seen) >= {*PLANTED.values(), *IN_FILES.values()}
    assert "rollout-key-1-" in json.dumps(first) or "rollout-key-0-" in json.dumps(second)  # a sibling's key too


def test_where_no_sandbox_can_start_an_agent_is_refused_unless_declared_process(tmp_path, tasks_file):
    """A host without user namespaces (here: a user namespace whose limit of nested ones is 0)."""
    limit = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
    no_userns = ("unshare", "--user", "--map-root-user", "sh", "-c", limit, "-")
    check = (
        "import json, sys; from tasks.environments.agents import AgentCommand; "
        "AgentCommand(tasks=sys.argv[1], **json.loads(sys.argv[2])).check_can_run()"
    )
    agent = {"command": [sys.executable, "-c", "pass"]}
    refused = subprocess.run(
        [*no_userns, sys.executable, "-c", check, str(tasks_file), json.dumps(agent)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode != 0
    assert "SandboxUnavailableError" in refused.stderr and "isolation: process" in refused.stderr
    assert "max_*_namespaces" in refused.stderr or "namespace" in refused.stderr  # bwrap's own reason
    findings = run_worker(tmp_path, tasks_file, {"isolation": ISOLATION_PROCESS}, prefix=no_userns)
    assert all(seen["call"] == "answered" for seen in findings)


def test_binds_show_what_they_name_read_only_unless_writable(tmp_path, tasks_file):
    worker_tmp = Path(tempfile.mkdtemp(prefix="worker-only-"))  # in the worker's /tmp: not the agent's
    data, out, hidden = tmp_path / "data", tmp_path / "out", tmp_path / "hidden"
    for folder in (data, out, hidden):
        folder.mkdir()
        (folder / "f.txt").write_text(folder.name)
    script = textwrap.dedent(
        """
        import json, os, sys
        data, out, hidden = sys.argv[1:]
        found = {"data": open(data + "/f.txt").read(), "hidden": os.path.exists(hidden)}
        for name, folder in (("data_writable", data), ("out_writable", out)):
            try:
                open(folder + "/new.txt", "w").write("x")
                found[name] = True
            except OSError:
                found[name] = False
        found["tmp"] = sorted(os.listdir("/tmp"))  # the binds' parents (pytest's folder) and nothing else
        print(json.dumps({"reward": 1, **found}))
        """
    )
    binds = [str(data), {"path": str(out), "writable": True}]
    agent = AgentCommand(
        command=[sys.executable, "-c", script, str(data), str(out), str(hidden)], tasks=str(tasks_file), binds=binds
    )
    from .test_agent_process import run

    info = run(agent).info
    worker_tmp.rmdir()
    assert info == {
        "data": "data",
        "hidden": False,
        "data_writable": False,
        "out_writable": True,
        "tmp": [tmp_path.relative_to("/tmp").parts[0]] if tmp_path.is_relative_to("/tmp") else [],
    }
    assert (out / "new.txt").read_text() == "x" and not (data / "new.txt").exists()


def test_a_command_whose_executable_is_not_found_is_refused_before_it_runs(tasks_file):
    agent = AgentCommand(command=["no-such-agent-binary"], tasks=str(tasks_file))
    with pytest.raises(AgentCommandError, match=r"no-such-agent-binary.*not found"):
        agent.check_can_run()
    AgentCommand(command=["{python}", "-c", "pass"], tasks=str(tasks_file)).check_can_run()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"isolation": "none"}, "isolation must be one of"),
        ({"binds": ["relative/path"]}, "not an absolute path"),
        ({"binds": ["/"]}, "not an absolute path below /"),
        ({"binds": [{"path": "/data", "writable": "yes"}]}, "writable of '/data' must be true or false"),
        ({"binds": ["/data"], "isolation": ISOLATION_PROCESS}, "binds are for 'sandbox'"),
    ],
)
def test_bad_isolation_options_are_refused(tasks_file, options, message):
    with pytest.raises(ValueError, match=message):
        AgentCommand(command=["true"], tasks=str(tasks_file), **options)


def test_the_sandbox_shows_the_files_a_command_names_and_no_folder_implicitly(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text("pass")
    named = Sandbox().named_files([sys.executable, str(script), str(tmp_path), "-c"], str(tmp_path), None)
    assert named == [str(script)]  # the interpreter is the worker's Python (shown); a folder is never implied
    assert Sandbox().visible(sys.executable) and not Sandbox().visible(str(tmp_path))
    assert AgentCommand.__init__.__kwdefaults__["isolation"] == ISOLATION_SANDBOX
