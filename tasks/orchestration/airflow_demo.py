"""``make demo``: one full ``rollout_batch`` DAG run through Airflow on the embedded defaults.

A local Airflow in ``.demo/airflow`` (SQLite metadata DB), batches under ``.demo/runs``, the
bundled SmolLM2-135M-Instruct served by ONE vLLM server on loopback (``.demo/server.log``) that
every generate task calls (engine ``vllm_server``, named by the Airflow connection
``rollout_servers`` as the trigger policy asks): one engine start in the whole demo. The
server stops when the run ends, on every path. ``dag.test()`` runs every task in this process
(generate in its child process), with the form's defaults unless ``--conf`` overrides some (a
``--conf`` naming another engine starts no server). While it runs the console shows one line per
task state change and generate heartbeat (:mod:`~tasks.orchestration.demo_console`; Airflow's
own log goes to ``.demo/airflow-run.log``); then the DAG run id, each task's state, where the
dataset and reports are, and the batch's summary table.

    python -m tasks.orchestration.airflow_demo [--home .demo] [--conf '{"num_tasks": 4}']
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.orchestration import local_airflow
from tasks.orchestration.demo_console import quiet_console
from tasks.orchestration.engine_servers import SERVERS_CONN_ID, servers_connection_variable

DAG_ID = "rollout_batch"


def run_dag(conf: dict[str, Any]) -> Any:
    """Run ``rollout_batch`` once with ``dag.test(run_conf=conf)``; the Airflow environment must be applied."""
    bag = local_airflow.dag_bag("rollout_batch.py")
    if bag.import_errors:
        raise RuntimeError(f"the DAG file does not import: {bag.import_errors}")
    return bag.dags[DAG_ID].test(run_conf=conf)


def task_states(dag_run: Any) -> list[tuple[str, str]]:
    """(task, state) for every task instance of the run, mapped ones named by their map index."""
    rows = []
    for ti in sorted(dag_run.get_task_instances(), key=lambda t: (t.priority_weight * -1, t.task_id, t.map_index)):
        name = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.rendered_map_index or ti.map_index}]"
        rows.append((name, str(ti.state)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tasks.orchestration.airflow_demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--home", type=Path, default=Path(".demo"), help="folder for the local Airflow and the batches")
    parser.add_argument("--conf", default="{}", help="run conf: batch form fields as a JSON object")
    args = parser.parse_args(argv)
    conf = json.loads(args.conf)
    home = args.home.resolve()
    environment = local_airflow.airflow_environment(home / "airflow", storage_url=f"file://{home / 'runs'}")
    local_airflow.apply(environment)
    phases = Phases()
    print(f"[1/4] local Airflow in {home / 'airflow'}: metadata DB, gpu pool", flush=True)
    with phases.timed("Airflow setup"):
        local_airflow.prepare(home / "airflow", os.environ)
    print("[2/4] the bundled model (converted once into the cache)", flush=True)
    from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference

    with phases.timed("model"):
        folder = resolve_model_reference(BUNDLED_REFERENCE)
    with phases.timed("vLLM server start"), demo_server(folder, home, skip="engine" in conf) as engine_fields:
        phases.end("vLLM server start")
        conf = {**engine_fields, **conf}
        print(f"[4/4] dag.test(): {DAG_ID} with run conf {json.dumps(conf)}", flush=True)
        with quiet_console(DAG_ID, home / "airflow-run.log"):
            dag_run = run_dag(conf)
    return report(dag_run, conf, phases=phases)


class Phases:
    """Wall seconds of the demo's phases before the DAG run, and of the whole demo."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds: dict[str, float] = {}
        self._open: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Time the block as ``name`` (or up to :meth:`end` of it, if that comes first)."""
        self._open[name] = time.monotonic()
        try:
            yield
        finally:
            self.end(name)

    def end(self, name: str) -> None:
        if name in self._open:
            self.seconds[name] = time.monotonic() - self._open.pop(name)

    def total(self) -> float:
        return time.monotonic() - self.started


@contextlib.contextmanager
def demo_server(folder: Path, home: Path, *, skip: bool) -> Iterator[dict[str, Any]]:
    """One vLLM server of ``folder`` on a free loopback port for the block: the batch fields that call it."""
    if skip:
        print("[3/4] no vLLM server: the run conf names its own engine", flush=True)
        yield {}
        return
    from tasks.batch_fields import field_default
    from tasks.engines.vllm.options import VllmOptions
    from tasks.engines.vllm_server.serving.launch import VllmServer, free_port

    name = ""
    key_file = home / "server-key"
    key_file.write_text(secrets.token_hex(16))
    key_file.chmod(0o600)
    port = free_port()
    log_path = home / "server.log"
    print(f"[3/4] one vLLM server on 127.0.0.1:{port} for every shard (log: {log_path})", flush=True)
    server = VllmServer.start(
        folder,
        VllmOptions.from_mapping(field_default("engine_options")),
        port=port,
        api_key=key_file.read_text(),
        log_path=log_path,
    )
    try:
        server.wait_ready()
        print(f"      ready at {server.url}", flush=True)
        name, connection = servers_connection_variable(server.url, key_file.read_text())
        os.environ[name] = connection
        yield {"engine": "vllm_server", "engine_options": {}, "engine_conn_id": SERVERS_CONN_ID}
    finally:
        os.environ.pop(name, None)
        server.stop()


def dag_run_seconds(dag_run: Any) -> float | None:
    """The DAG run's own duration, Airflow's run start to end (None while either is unset)."""
    if dag_run.start_date is None or dag_run.end_date is None:
        return None
    return (dag_run.end_date - dag_run.start_date).total_seconds()


def report(dag_run: Any, conf: dict[str, Any], *, phases: Phases) -> int:
    """Print the run's outcome, its duration apart from what came before it, and the batch summary; 0 on success."""
    from tasks.demo import batch_summary, print_summary
    from tasks.orchestration.form import form_defaults
    from tasks.orchestration.steps import run_batch, run_batch_id

    params = {**form_defaults(), **conf}
    batch_id = run_batch_id(params, dag_run)
    seconds, run_seconds = phases.total(), dag_run_seconds(dag_run)
    took = f"in {run_seconds:.0f} s (Airflow's run start to end)" if run_seconds is not None else "(no end time)"
    print(f"\nDAG run {dag_run.run_id}: {dag_run.state} {took} (batch {batch_id})")
    before = ", ".join(f"{name} {s:.0f} s" for name, s in phases.seconds.items())
    print(f"  before the run: {before}; the whole demo {seconds:.0f} s")
    for name, state in task_states(dag_run):
        print(f"  {name.ljust(28)} {state}")
    if str(dag_run.state) != "success":
        print("the run did not succeed: the failed task's log above says why", file=sys.stderr)
        return 1
    print_summary(batch_summary(run_batch(params, dag_run), wall_seconds=seconds))
    print(lineage_line(dag_run))
    return 0


def lineage_line(dag_run: Any) -> str:
    """How many OpenLineage events the run's tasks wrote to the local Airflow's events file, and their size."""
    home = Path(os.environ["AIRFLOW_HOME"])
    events = local_airflow.task_lineage_events(home, dag_run.dag_id, dag_run.run_id)
    size = sum(len(json.dumps(event)) + 1 for event in events)
    where = local_airflow.lineage_events_file(home)
    return f"lineage: {len(events)} OpenLineage events of its tasks ({size / 1024:.0f} KiB) in {where}"


if __name__ == "__main__":
    raise SystemExit(main())
