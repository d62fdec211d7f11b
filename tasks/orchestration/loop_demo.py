"""``make demo-loop``: the training loop through Airflow, driven by its assets, on the bundled model (docs/loop.md).

A local Airflow in ``.demo/loop/airflow`` (SQLite metadata DB; api-server, scheduler and DAG
processor as processes of their own, LocalExecutor), batches under ``.demo/loop/runs``,
checkpoints under ``.demo/loop/checkpoints`` (the deployment's checkpoints root), and ONE vLLM
server of the bundled SmolLM2-135M-Instruct on loopback (``.demo/loop/server.log``), named by the
``rollout_servers`` connection. Checkpoint 0 is the bundled model's files; the demo announces it
as an external trainer would, through Airflow's REST API. From then on Airflow's scheduler runs the
loop by itself::

    policy_checkpoint -> policy_refit_batch (verify, refit, plan, generate, suites, finalize, publish)
      -> grpo_dataset -> grpo_train (one step) -> policy_checkpoint -> ...

until ``max_steps`` (= ``--iterations``): the last step's checkpoint is written and not announced.
The console shows each task's state changes; then, per iteration, the weight version and sha256
that sampled the batch (as the servers verified them), rows, mean reward, the step-0 ratio, the
loss and each stage's seconds, and finally ``rollout-ledger lineage`` of the last checkpoint.

    python -m tasks.orchestration.loop_demo [--home .demo/loop] [--iterations 3] [--timeout 900]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tasks.orchestration import local_airflow, loop
from tasks.orchestration.engine_servers import servers_connection_variable
from tasks.orchestration.loop_dag import REFIT_DAG_ID, TRAIN_DAG_ID

LOOP_DAGS = (REFIT_DAG_ID, TRAIN_DAG_ID)
STAGES = (  # (label, DAG, task) in the order a loop iteration runs them
    ("verify", REFIT_DAG_ID, "verify_checkpoint"),
    ("refit", REFIT_DAG_ID, "refit"),
    ("plan", REFIT_DAG_ID, "plan"),
    ("generate", REFIT_DAG_ID, "generate"),
    ("lineage suite", REFIT_DAG_ID, "validate_lineage"),
    ("finalize", REFIT_DAG_ID, "finalize"),
    ("dataset suite", REFIT_DAG_ID, "validate_dataset"),
    ("publish", REFIT_DAG_ID, "publish"),
    ("train", TRAIN_DAG_ID, "train"),
    ("announce", TRAIN_DAG_ID, "announce_checkpoint"),
)
POLL_SECONDS = 2.0
START_TIMEOUT = 900.0  # seconds for the api-server (and the vLLM server) to answer on a busy 2-core machine


def say(line: str = "") -> None:
    print(line, flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def vllm_server(folder: Path, home: Path) -> Iterator[tuple[Any, str]]:
    """One keyed vLLM server of ``folder`` on a free loopback port (RL endpoints and weight records on), started and
    not yet waited for: (server, key). It stops when the block ends."""
    from tasks.batch_fields import field_default
    from tasks.engines.vllm.options import VllmOptions
    from tasks.engines.vllm_server.serving.launch import VllmServer

    key = secrets.token_hex(16)
    server = VllmServer.start(
        folder,
        VllmOptions.from_mapping(field_default("engine_options")),
        port=free_port(),
        api_key=key,
        log_path=home / "server.log",
    )
    try:
        yield server, key
    finally:
        server.stop()


def loop_dags_folder(folder: Path) -> Path:
    """A DAG folder holding only the loop's two DAG files (links to this checkout's): the DAG processor of a small
    machine parses two files, not every DAG of ``dags/``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("policy_refit_batch.py", "grpo_train.py"):
        link = folder / name
        if not link.is_symlink():
            link.symlink_to(local_airflow.DAGS_FOLDER / name)
    return folder


@contextlib.contextmanager
def airflow_processes(
    environment: Mapping[str, str], port: int, logs: Path, *, timeout: float = START_TIMEOUT
) -> Iterator[str]:
    """api-server, scheduler and DAG processor of the local Airflow, each in its own process group; yields the URL."""
    import httpx

    airflow = [sys.executable, "-m", "airflow"]
    commands = {
        "api-server": [*airflow, "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        "scheduler": [*airflow, "scheduler"],
        "dag-processor": [*airflow, "dag-processor"],
    }
    started: list[subprocess.Popen] = []
    url = f"http://127.0.0.1:{port}"
    try:
        for name, argv in commands.items():
            with (logs / f"{name}.log").open("w") as out:
                started.append(
                    subprocess.Popen(
                        argv, stdout=out, stderr=subprocess.STDOUT, env=dict(environment), start_new_session=True
                    )
                )
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/api/v2/version", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline or any(p.poll() is not None for p in started):
                raise RuntimeError(f"Airflow did not start: see the logs in {logs}")
            time.sleep(1)
        yield url
    finally:
        stop_all(started)


def stop_all(started: list[subprocess.Popen]) -> None:
    """SIGTERM to each component's process group, then SIGKILL to what is left of it and of every descendant seen
    before (a task process runs in a session of its own, outside its scheduler's group)."""
    import psutil

    descendants = []
    for process in started:
        with contextlib.suppress(psutil.Error):
            descendants += psutil.Process(process.pid).children(recursive=True)
    for process in reversed(started):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    for process in reversed(started):
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()


def components_environment(port: int, dags_folder: Path) -> dict[str, str]:
    """What the api-server, scheduler and DAG processor (and the LocalExecutor's tasks) share beyond the local
    Airflow's variables: one JWT secret, the execution API's URL, a DAG folder parsed once (re-parsing every 30 s
    costs a core on a 2-core machine, and a parse there may take minutes)."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}/",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "3600",
        "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "600",
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "600",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
    }


def loop_environment(home: Path, *, port: int, iterations: int, server: tuple[str, str]) -> dict[str, str]:
    """The local Airflow's variables, its components talking over loopback, and the deployment's loop settings."""
    environment = local_airflow.airflow_environment(home / "airflow", storage_url=f"file://{home / 'runs'}")
    conn_name, conn_value = servers_connection_variable(*server)
    return {
        **os.environ,
        **environment,
        **components_environment(port, loop_dags_folder(home / "dags")),
        conn_name: conn_value,
        loop.CHECKPOINTS_ROOT_VARIABLE: str(home / "checkpoints"),
        loop.MAX_STEPS_VARIABLE: str(iterations),
    }


class Watch:
    """Polls the REST API for the loop DAGs' runs and task states; prints each change with the seconds since start."""

    def __init__(self, api: Any, started: float) -> None:
        self.api, self.started = api, started
        self.states: dict[tuple[str, str, str], str] = {}

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        response = self.api.client.get(f"/api/v2/dags/{dag_id}/dagRuns", params={"order_by": "id", "limit": 100})
        response.raise_for_status()
        return list(response.json()["dag_runs"])

    def tasks(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        response = self.api.client.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100})
        response.raise_for_status()
        return list(response.json()["task_instances"])

    def xcom(self, dag_id: str, run_id: str, task_id: str) -> Any:
        response = self.api.client.get(
            f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value",
            params={"deserialize": "true", "stringify": "false"},
        )
        return response.json().get("value") if response.status_code == 200 else None

    def poll(self) -> None:
        for dag_id in LOOP_DAGS:
            for index, run in enumerate(self.runs(dag_id)):
                for ti in self.tasks(dag_id, run["dag_run_id"]):
                    name = ti["task_id"] if ti["map_index"] < 0 else f"{ti['task_id']}[{ti['map_index']}]"
                    key = (dag_id, run["dag_run_id"], name)
                    state = ti["state"] or "scheduled"
                    if self.states.get(key) != state:
                        self.states[key] = state
                        elapsed = time.monotonic() - self.started
                        say(f"  {elapsed:5.0f} s  {dag_id} #{index + 1} {name.ljust(22)} {state}")

    def wait(self, iterations: int, timeout: float) -> list[str]:
        """Until grpo_train ran ``iterations`` times, all runs done; the failed runs' ids (empty: all succeeded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # a busy SQLite behind the API: next poll
                self.poll()
                runs = {dag_id: self.runs(dag_id) for dag_id in LOOP_DAGS}
                failed = [f"{d} {r['dag_run_id']}" for d, rs in runs.items() for r in rs if r["state"] == "failed"]
                if failed:
                    return failed
                done = [r for r in runs[TRAIN_DAG_ID] if r["state"] == "success"]
                active = [r for rs in runs.values() for r in rs if r["state"] in ("queued", "running")]
                if len(done) >= iterations and not active:
                    return []
            time.sleep(POLL_SECONDS)
        raise TimeoutError(f"the loop did not finish {iterations} iterations in {timeout:.0f} s")


def seconds(ti: Mapping[str, Any]) -> float:
    return float(ti.get("duration") or 0.0)


def iteration_report(watch: Watch, refit_run: str, train_run: str) -> dict[str, Any]:
    """What one iteration sampled and trained, and each stage's seconds (a mapped task: its slowest instance)."""
    from tasks.batch import Batch
    from tasks.demo import batch_summary

    runs = {REFIT_DAG_ID: refit_run, TRAIN_DAG_ID: train_run}
    instances = {dag_id: watch.tasks(dag_id, run_id) for dag_id, run_id in runs.items()}
    stages = {}
    for label, dag_id, task_id in STAGES:
        found = [seconds(ti) for ti in instances[dag_id] if ti["task_id"] == task_id]
        stages[label] = max(found, default=0.0)
    checkpoint = watch.xcom(REFIT_DAG_ID, refit_run, "verify_checkpoint") or {}
    published = watch.xcom(REFIT_DAG_ID, refit_run, "publish") or {}
    trained = watch.xcom(TRAIN_DAG_ID, train_run, "train") or {}
    batch_url = published["dataset"].removesuffix("/dataset")
    root, _, batch_id = batch_url.rpartition("/batches/")
    batch = Batch.open(root, batch_id)
    summary = batch_summary(batch, wall_seconds=0.0)
    weights = batch.dataset_metrics(batch.published_dataset()).get("weights_by_version") or {}
    starts = [ti["start_date"] for tis in instances.values() for ti in tis if ti.get("start_date")]
    ends = [ti["end_date"] for tis in instances.values() for ti in tis if ti.get("end_date")]
    metrics = trained.get("metrics") or {}
    return {
        "checkpoint": checkpoint,
        "refit": (watch.xcom(REFIT_DAG_ID, refit_run, "refit") or {}).get("refit"),
        "sampled": weights,
        "batch_id": batch_id,
        "rows": summary["trainable_rows"] + summary["masked_rows"],
        "trainable_rows": summary["trainable_rows"],
        "mean_reward": summary["mean_reward"],
        "step0_ratio": metrics.get("step0_ratio"),
        "loss": metrics.get("loss"),
        "trained_step": trained.get("step"),
        "said": trained.get("said"),
        "stages": stages,
        "wall": _span(starts, ends),
    }


def _span(starts: list[str], ends: list[str]) -> float | None:
    from datetime import datetime

    if not starts or not ends:
        return None
    return (datetime.fromisoformat(max(ends)) - datetime.fromisoformat(min(starts))).total_seconds()


def print_iteration(number: int, report: Mapping[str, Any]) -> None:
    checkpoint = report["checkpoint"]
    ratio = report["step0_ratio"] or {}
    sampled = "; ".join(
        f"version {v}: {w.get('weights')} sha256 {w.get('weights_sha256')}" for v, w in report["sampled"].items()
    )
    loss = report["loss"]
    say(f"\niteration {number}: checkpoint step {checkpoint.get('step')} ({checkpoint.get('folder')})")
    say(f"  sampled by       {sampled or 'unknown'} (refit: {report['refit']})")
    say(f"  batch            {report['batch_id']}: {report['rows']} rows ({report['trainable_rows']} trainable)")
    say(f"  mean reward      {report['mean_reward']}")
    say(
        f"  step-0 ratio     mean {ratio.get('mean')}, min {ratio.get('min')}, max {ratio.get('max')} "
        f"over {ratio.get('tokens')} tokens"
    )
    say(f"  loss             {loss if loss is None else f'{loss:.6f}'}")
    say(f"  trained          {report['said']}")
    stages = ", ".join(f"{label} {s:.0f}" for label, s in report["stages"].items())
    wall = report["wall"]
    in_tasks = sum(report["stages"].values())
    say(f"  seconds          {stages}")
    if wall is not None:
        say(f"                   iteration {wall:.0f} s first task start to last task end ({in_tasks:.0f} s in tasks)")


def run_lineage(folder: str) -> int:
    """``rollout-ledger lineage <checkpoint>``: the walk back from the last checkpoint, every hop checked."""
    command = [sys.executable, "-m", "tasks.cli", "lineage", folder]
    say(f"\n$ rollout-ledger lineage {folder}")
    done = subprocess.run(command, check=False, text=True, capture_output=True)
    say((done.stdout + done.stderr).rstrip())
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.orchestration.loop_demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--home", type=Path, default=Path(".demo/loop"), help="folder for Airflow, batches, checkpoints"
    )
    parser.add_argument("--iterations", type=int, default=3, help="training steps, = the deployment's max_steps")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds the loop may take once announced")
    parser.add_argument("--batch", default=None, help="batch fields for policy_refit_batch (JSON; the deployment's)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the servers on the way out
    home = args.home.resolve()
    for stale in ("airflow", "runs", "checkpoints"):  # each demo is a loop of its own, from checkpoint 0
        shutil.rmtree(home / stale, ignore_errors=True)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    times: dict[str, float] = {}

    def mark(name: str, since: float) -> float:
        times[name] = time.monotonic() - since
        return time.monotonic()

    say(f"[1/5] local Airflow in {home / 'airflow'}: metadata DB, gpu pool")
    environment = local_airflow.airflow_environment(home / "airflow", storage_url=f"file://{home / 'runs'}")
    local_airflow.prepare(home / "airflow", {**os.environ, **environment})
    since = mark("Airflow DB", started)
    say("[2/5] checkpoint 0: the bundled model's files under the checkpoints root")
    from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
    from tasks.trainer.checkpoint import checkpoint_zero

    model = resolve_model_reference(BUNDLED_REFERENCE)
    zero = checkpoint_zero(model, home / "checkpoints")
    say(f"      {zero.folder}: weights sha256 {zero.weights_sha256}")
    since = mark("checkpoint 0", since)
    say(f"[3/5] one vLLM server of the bundled model (log: {home / 'server.log'}), started")
    with vllm_server(model, home) as (server, key):
        port = free_port()
        env = loop_environment(home, port=port, iterations=args.iterations, server=(server.url, key))
        if args.batch:
            env[loop.LOOP_BATCH_VARIABLE] = args.batch
        say(f"[4/5] api-server on 127.0.0.1:{port}, scheduler, DAG processor (logs: {home / 'logs'}), started")
        with airflow_processes(env, port, home / "logs") as url:
            say(f"      Airflow answers at {url}")
            since = mark("Airflow start", since)
            server.wait_ready(timeout=START_TIMEOUT)
            say(f"      vLLM server ready at {server.url}")
            since = mark("vLLM server ready", since)
            from tasks.orchestration.loop_api import AirflowApi, announce_checkpoint

            api = AirflowApi.login(url, *local_airflow.LOGIN)
            while api.asset_id(loop.POLICY_CHECKPOINT_ASSET) is None or not _parsed(api):
                time.sleep(1)
            for dag_id in LOOP_DAGS:
                api.unpause(dag_id)
            since = mark("loop DAGs parsed", since)
            extra = loop.manifest_event(zero, zero.folder).to_extra()
            posted = announce_checkpoint(api, extra)
            say(f"[5/5] POST /api/v2/assets/events: policy_checkpoint step 0 (event {posted['id']}); the loop runs")
            watch = Watch(api, time.monotonic())
            failed = watch.wait(args.iterations, args.timeout)
            since = mark("loop", since)
            if failed:
                say(f"\nthe loop stopped: failed run(s) {failed}; see the task logs under {home / 'airflow' / 'logs'}")
                return 1
            refit_runs = [r["dag_run_id"] for r in watch.runs(REFIT_DAG_ID)]
            train_runs = [r["dag_run_id"] for r in watch.runs(TRAIN_DAG_ID)]
            reports = [iteration_report(watch, a, b) for a, b in zip(refit_runs, train_runs, strict=False)]
            api.close()
    for number, report in enumerate(reports, start=1):
        print_iteration(number, report)
    say("\nbefore and around the loop: " + ", ".join(f"{name} {s:.0f} s" for name, s in times.items()))
    say(f"the whole demo: {time.monotonic() - started:.0f} s")
    (home / "loop-report.json").write_text(json.dumps({"iterations": reports, "times": times}, indent=2, default=str))
    last = max(((home / "checkpoints").glob("step-*")), key=lambda p: p.name)
    return run_lineage(str(last))


def _parsed(api: Any) -> bool:
    """Whether the DAG processor has parsed both loop DAGs."""
    return all(api.client.get(f"/api/v2/dags/{dag_id}").status_code == 200 for dag_id in LOOP_DAGS)


if __name__ == "__main__":
    raise SystemExit(main())
