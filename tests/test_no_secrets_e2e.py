"""No secret reaches anything a batch writes: secrets planted wherever a user could put one, then everything grepped.

Planted: the storage's credentials (AWS variables of the CLI), the servers' API key (its file),
worker secrets an agent must not see (Airflow's Fernet key, a Hugging Face token, a worker
OpenAI key; also in the worker's credential files ``~/.aws/credentials`` and ``airflow.cfg``), a
tool token the registry entry passes to its agent (which prints it, its whole environment, and
every ``/proc/*/environ``, ``/proc/*/cmdline`` and credential file it can read into its reward
info and its failure output), and a password in a server URL (refused without echoing it). The
batch runs plan, generate (an agent command through the capture gateway on the test run's vLLM
server, on S3), finalize and status from the CLI with OpenLineage events written to a file.
Grepped: every object under the bucket (config, plan, staging, ledger, receipts, reports, dataset
card and rows; a Parquet file both as bytes and decoded, since compression could hide a string),
every command's stdout and stderr, and every lineage event.
"""

from __future__ import annotations

import io
import json
import textwrap
import uuid

import pyarrow.parquet as pq
import pytest

from tasks.environments.declared import REGISTRY_VARIABLE
from tasks.models.bundled import HOME_ENV, cache_dir

from .lineage.test_cli_lineage import file_transport
from .test_cli import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
AGENT = textwrap.dedent(
    """
    import glob, json, os, sys
    import openai

    task = json.loads(os.environ["ROLLOUT_LEDGER_TASK"])
    reply = openai.OpenAI().chat.completions.create(
        model="m", messages=[{"role": "user", "content": task["question"]}], max_tokens=8
    )
    found = {}  # every /proc/*/environ and cmdline it can see, and the worker's credential files (tool code could)
    for name in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline") + task["files"]:
        try:
            found[name] = open(name, "rb").read().decode("latin-1")
        except OSError as error:
            found[name] = "unreadable: " + error.strerror
    sys.stderr.write(json.dumps(dict(os.environ)))
    if task["i"] % 2:
        sys.exit(f"failing on purpose with {os.environ['TOOL_TOKEN']} and {os.environ['OPENAI_API_KEY']}")
    report = {"reward": 1, "token": os.environ["TOOL_TOKEN"], "env": dict(os.environ), "found": found}
    print(json.dumps({**report, "answered": bool(reply.choices[0].message.content is not None)}))
    """
)


def test_no_planted_secret_reaches_anything_a_batch_writes(vllm_server, s3_bucket, tmp_path, monkeypatch):
    planted = {name: f"planted-{name.lower()}-{uuid.uuid4().hex}" for name in ("aws_key", "aws_secret", "session")}
    planted |= {name: f"planted-{name}-{uuid.uuid4().hex}" for name in ("fernet", "hf", "openai", "tool", "url")}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", planted["aws_key"])  # moto takes any credentials
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", planted["aws_secret"])
    monkeypatch.setenv("AWS_SESSION_TOKEN", planted["session"])
    monkeypatch.setenv("AIRFLOW__CORE__FERNET_KEY", planted["fernet"])
    monkeypatch.setenv("HF_TOKEN", planted["hf"])
    monkeypatch.setenv("OPENAI_API_KEY", planted["openai"])
    monkeypatch.setenv("TOOL_TOKEN", planted["tool"])
    lineage = tmp_path / "lineage.jsonl"
    monkeypatch.delenv("OPENLINEAGE_DISABLED", raising=False)
    for name, value in file_transport(lineage).items():  # the variable the CLI reads first
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(HOME_ENV, str(cache_dir()))  # the model's cache stays where it is when HOME moves
    worker_home, airflow_home = tmp_path / "worker-home", tmp_path / "airflow"  # the worker's credential files
    (worker_home / ".aws").mkdir(parents=True)
    airflow_home.mkdir()
    (worker_home / ".aws" / "credentials").write_text(f"[default]\naws_secret_access_key = {planted['aws_secret']}\n")
    (airflow_home / "airflow.cfg").write_text(f"[core]\nfernet_key = {planted['fernet']}\n")
    monkeypatch.setenv("HOME", str(worker_home))
    monkeypatch.setenv("AIRFLOW_HOME", str(airflow_home))
    files = [str(worker_home / ".aws" / "credentials"), str(airflow_home / "airflow.cfg"), vllm_server.key_file]
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "tasks.jsonl").write_text(
        "".join(json.dumps({"i": i, "question": f"{i} + 1?", "files": files}) + "\n" for i in range(4))
    )
    registry = tmp_path / "environments.yaml"
    registry.write_text(
        "environments:\n  echo_agent:\n    kind: agent_command\n    env: [TOOL_TOKEN]\n"
        '    options: {command: ["{python}", "{here}/agent.py"], tasks: tasks.jsonl, timeout_s: 120}\n'
    )
    monkeypatch.setenv(REGISTRY_VARIABLE, str(registry))
    secrets = {**planted, "server_key": vllm_server.key}
    root, batch_id = f"{s3_bucket}/runs", "b-secrets"
    engine = [f"--engine-option={key}={json.dumps(v)}" for key, v in vllm_server.engine_options().items()]
    sized = ["--num-tasks", "4", "--group-size", "1", "--shards", "1", "--max-turns", "2", "--max-tokens", "8"]
    refused_url = vllm_server.url.replace("http://", f"http://user:{planted['url']}@")
    outputs = [
        run_cli(
            "plan", "--root", root, "--batch-id", "b-url", *sized, "--environment", "echo_agent",
            "--engine", "vllm_server", f"--engine-option=urls={json.dumps([refused_url])}",
        ),
        run_cli(
            "plan", "--root", root, "--batch-id", batch_id, *sized, "--environment", "echo_agent",
            "--engine", "vllm_server", *engine, "--max-poisoned-rate", "1", "--max-invalid-row-rate", "1",
        ),
    ]  # fmt: skip
    assert outputs[0].returncode == 2 and "carries credentials" in outputs[0].stderr
    assert outputs[1].returncode == 0, outputs[1].stderr
    for command in (["generate", "--all-shards", "--no-progress"], ["finalize", "--no-audit"], ["status"]):
        outputs.append(run_cli(command[0], "--root", root, "--batch-id", batch_id, *command[1:]))
        assert outputs[-1].returncode == 0, outputs[-1].stderr[-3000:]
    generated = json.loads(outputs[2].stdout)[0]
    assert (generated["ok"], generated["failed"]) == (2, 2)  # the agents ran, printed, and half failed

    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    written = {path: fs.cat_file(path) for path in fs.find(s3_bucket.removeprefix("s3://"))}
    written |= {f"{path} decoded": decoded(data) for path, data in written.items() if path.endswith(".parquet")}
    assert any(path.endswith("dataset/README.md") for path in written) and lineage.stat().st_size > 0
    written |= {f"stdout of {out.args[3]}": out.stdout.encode() for out in outputs}
    written |= {f"stderr of {out.args[3]}": out.stderr.encode() for out in outputs}
    written["lineage events"] = lineage.read_bytes()
    found = [
        (name, where) for where, data in written.items() for name, secret in secrets.items() if secret.encode() in data
    ]
    assert not found, f"secrets written: {found}"
    receipts = b"".join(data for path, data in written.items() if "/receipts-" in path)
    assert b"[redacted]" in receipts  # the agents did print the tool token: it was caught, not absent
    # They did look, through their sandbox, and their own gateway call worked: /proc showed bwrap and themselves
    # only, each credential file was not there.
    infos = [
        json.loads(info)
        for path, data in written.items()
        if "/receipts-" in path and path.endswith(".parquet")
        for info in pq.read_table(io.BytesIO(data)).column("reward_info").to_pylist()
        if info and "found" in info
    ]
    assert len(infos) == 2 and all(info["answered"] for info in infos)
    for info in infos:
        assert sorted(name for name in info["found"] if name.startswith("/proc")) == [
            "/proc/1/cmdline", "/proc/1/environ", "/proc/2/cmdline", "/proc/2/environ",
        ]  # fmt: skip
        assert all(info["found"][name] == "unreadable: No such file or directory" for name in files)


def decoded(parquet: bytes) -> bytes:
    """A Parquet file's rows as JSON text."""
    return json.dumps(pq.read_table(io.BytesIO(parquet)).to_pylist(), default=str).encode()
