"""A local Airflow for this checkout: one folder holds its config, SQLite metadata DB and logs.

Used by ``make demo`` (a ``dag.test()`` run), ``make airflow`` (``airflow standalone`` with the
UI) and the tests. Airflow reads its settings when it is first imported, so
:func:`airflow_environment` is applied to ``os.environ`` (or a child's environment) before
anything imports ``airflow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.batch_fields import STORAGE_URL_VARIABLE

CHECKOUT = Path(__file__).resolve().parents[2]
DAGS_FOLDER = CHECKOUT / "dags"
PLUGINS_FOLDER = CHECKOUT / "plugins"
GPU_POOL = "gpu"
LOGIN = ("admin", "admin")  # the simple auth manager's user for `make airflow` (local use only)


def airflow_environment(home: Path, *, storage_url: str | None = None, gpu_slots: int = 1) -> dict[str, str]:
    """Variables that point Airflow at ``home`` (SQLite DB, logs) and this checkout's dags and plugins.

    Parallelism 2 fits this project's 2-core machines; the simple auth manager gets the
    :data:`LOGIN` user from a passwords file in ``home``; OpenLineage events go to
    :func:`lineage_events_file` (docs/lineage.md).
    """
    home = home.resolve()
    transport = {"type": "file", "log_file_path": str(lineage_events_file(home)), "append": True}
    return {
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(transport),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS_FOLDER),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": "2",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{LOGIN[0]}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "simple_auth_manager_passwords.json"),
        "ROLLOUT_LEDGER_GPU_SLOTS": str(gpu_slots),
        "GX_ANALYTICS_ENABLED": "False",
        STORAGE_URL_VARIABLE: storage_url or f"file://{home.parent / 'runs'}",
    }


def lineage_events_file(home: Path) -> Path:
    """Where the local Airflow's OpenLineage file transport appends its events, one JSON object per line."""
    return home.resolve() / "openlineage-events.jsonl"


def task_lineage_events(home: Path, dag_id: str, run_id: str) -> list[dict[str, Any]]:
    """The OpenLineage events of DAG run ``run_id``'s tasks in :func:`lineage_events_file`, in the order written."""
    path = lineage_events_file(home)
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [
        event
        for event in events
        if event["run"]["facets"].get("airflow", {}).get("dagRun", {}).get("run_id") == run_id
        and event["job"]["name"].startswith(f"{dag_id}.")
    ]


def prepare(home: Path, environ: Mapping[str, str]) -> None:
    """Create ``home``, the login's passwords file, the metadata DB (``airflow db migrate``) and the ``gpu`` pool."""
    home.mkdir(parents=True, exist_ok=True)
    passwords = Path(environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
    if not passwords.exists():
        passwords.write_text(json.dumps({LOGIN[0]: LOGIN[1]}))
    airflow = [sys.executable, "-m", "airflow"]
    subprocess.run([*airflow, "db", "migrate"], env=dict(environ), check=True, capture_output=True, text=True)
    slots = environ.get("ROLLOUT_LEDGER_GPU_SLOTS", "1")
    description = "generate tasks: one engine per slot (set it to the GPUs of your workers)"
    subprocess.run(
        [*airflow, "pools", "set", GPU_POOL, slots, description], env=dict(environ), check=True, capture_output=True
    )


def dag_bag(dag_file: str | None = None) -> Any:
    """This checkout's DAGs parsed as the DAG processor parses them (a DAG bundle: its folder is on ``sys.path``)."""
    from airflow.dag_processing.dagbag import BundleDagBag

    folder = str(DAGS_FOLDER)
    return BundleDagBag(
        dag_folder=str(DAGS_FOLDER / dag_file) if dag_file else folder, bundle_path=folder, bundle_name="dags-folder"
    )


def apply(environment: Mapping[str, str]) -> None:
    """Set the variables in this process (before ``airflow`` is imported)."""
    if "airflow" in sys.modules and os.environ.get("AIRFLOW_HOME") != environment["AIRFLOW_HOME"]:
        raise RuntimeError("airflow was imported before its environment was set: it read other settings")
    os.environ.update(environment)


def main(argv: list[str] | None = None) -> int:
    """``env``: print ``export`` lines for a shell; ``standalone``: prepare and run ``airflow standalone`` (the UI)."""
    import argparse
    import shlex

    parser = argparse.ArgumentParser(prog="python -m tasks.orchestration.local_airflow", description=__doc__)
    parser.add_argument("command", choices=("env", "standalone"))
    parser.add_argument("--home", type=Path, default=Path(".demo/airflow"), help="the local Airflow's folder")
    args = parser.parse_args(argv)
    environment = airflow_environment(args.home)
    if args.command == "env":
        print("\n".join(f"export {key}={shlex.quote(value)}" for key, value in environment.items()))
        return 0
    bin_dir = str(Path(sys.executable).parent)  # standalone starts its components as `airflow ...` from PATH
    full = {**os.environ, **environment, "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
    prepare(args.home.resolve(), full)
    print(f"Airflow UI on http://localhost:8080 once started; login {LOGIN[0]} / {LOGIN[1]}", flush=True)
    print(f"batches are written under {environment[STORAGE_URL_VARIABLE]}", flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "airflow", "standalone"], full)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
