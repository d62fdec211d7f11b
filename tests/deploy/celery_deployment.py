"""A small Airflow deployment on loopback: PostgreSQL, Redis, scheduler, dag-processor, api-server, two Celery workers.

The layout ``docs/deploy.md`` describes, on one machine: the CeleryExecutor with PostgreSQL as the
metadata DB and result backend and Redis as the broker; one worker takes queue ``gpu`` (generate),
the other queue ``default`` (everything else), each with concurrency 1 and its own host name
(:mod:`tests.deploy.worker_hostname`), as if they were two machines. PostgreSQL refuses to run as
root, so it runs as ``nobody`` when the test runs as root. Every process and its log belong to a
:class:`~tests.deploy.processes.Services`; leaving :func:`celery_deployment` stops them all.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tasks.orchestration import local_airflow
from tests.deploy import worker_hostname
from tests.deploy.processes import Services, free_port

PG_BIN = Path(os.environ.get("ROLLOUT_LEDGER_PG_BIN", "/usr/lib/postgresql/15/bin"))
REDIS_SERVER = os.environ.get("ROLLOUT_LEDGER_REDIS_SERVER", "redis-server")
PG_USER = "nobody"  # who runs PostgreSQL when the test runs as root (initdb refuses root)
DB_NAME = "airflow"
WORKERS = {"gpu-worker": "gpu", "cpu-worker": "default"}  # worker name -> the queue it serves
STARTUP_TIMEOUT = 240.0


@dataclass
class Deployment:
    """A running deployment: its REST API (logged in as the local admin) and its metadata DB."""

    services: Services
    api_url: str
    database_dsn: str
    home: Path
    client: httpx.Client

    def api(self, method: str, path: str, body: Any = None) -> Any:
        response = self.client.request(method, f"{self.api_url}/api/v2{path}", json=body)
        if response.is_error:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json() if response.content else None

    def trigger(self, dag_id: str, conf: Mapping[str, Any]) -> str:
        """Trigger a run with ``conf`` through the REST API; return its run id."""
        return self.api("POST", f"/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": dict(conf)})["dag_run_id"]

    def wait_for_run(self, dag_id: str, run_id: str, *, timeout: float) -> str:
        """Wait until the run ends; return its state (``success`` or ``failed``)."""
        state: dict[str, str] = {}

        def ended() -> bool:
            state["run"] = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]
            return state["run"] in ("success", "failed")

        self.services.wait_until(f"the end of run {run_id}", ended, timeout=timeout, interval=5.0)
        return state["run"]

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        """The run's task instances as the metadata DB records them (hostname, queue, Celery task id, ...)."""
        import psycopg2
        import psycopg2.extras

        query = (
            "SELECT task_id, map_index, state, hostname, queue, pool, try_number, external_executor_id"
            " FROM task_instance WHERE dag_id = %s AND run_id = %s ORDER BY task_id, map_index"
        )
        with (
            psycopg2.connect(self.database_dsn) as connection,
            connection.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cursor,
        ):
            cursor.execute(query, (dag_id, run_id))
            return [dict(row) for row in cursor.fetchall()]

    def celery_task_ids(self, worker: str) -> set[str]:
        """Ids of the Celery tasks ``worker`` received, from its own log."""
        text = self.services.log_dir.joinpath(f"{worker}.log").read_text(errors="replace")
        return set(re.findall(r"Task \S+\[([0-9a-f-]{36})\] received", text))


@contextmanager
def celery_deployment(root: Path) -> Iterator[Deployment]:
    """Start the whole deployment under ``root`` (logs in ``root/logs``); stop every process on exit.

    Raises after a clean exit when any process of the deployment outlived :meth:`Services.stop`.
    """
    services = Services(root / "logs")
    pg_root = Path(tempfile.mkdtemp(prefix="rollout-ledger-pg-"))  # under /tmp: pytest's folders are private
    pg_root.chmod(0o755)
    try:
        database = start_postgres(services, pg_root / "data")
        broker = start_redis(services)
        api_port = free_port()
        home = root / "airflow"
        environment = {
            **_base_environment(),
            **airflow_settings(home, database=database, broker=broker, api_port=api_port),
        }
        airflow = [sys.executable, "-m", "airflow"]
        services.run("db-migrate", [*airflow, "db", "migrate"], environment, timeout=600)  # its log is kept
        local_airflow.prepare(home, environment)  # the admin's password and the gpu pool (1 slot)
        api_server = [*airflow, "api-server", "--host", "127.0.0.1", "--port", str(api_port)]
        services.start("api-server", api_server, environment)
        services.start("scheduler", [*airflow, "scheduler"], environment)
        services.start("dag-processor", [*airflow, "dag-processor"], environment)
        for worker, queue in WORKERS.items():
            worker_environment = {
                **environment,
                "AIRFLOW__CORE__HOSTNAME_CALLABLE": f"{worker_hostname.__name__}.hostname",
                worker_hostname.HOSTNAME_VARIABLE: worker,
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),  # one log server per worker
            }
            argv = [*airflow, "celery", "worker", "-q", queue, "--concurrency", "1"]
            services.start(worker, [*argv, "--celery-hostname", f"{worker}@%h"], worker_environment)
        with httpx.Client(timeout=30.0) as client:
            deployment = Deployment(services, f"http://127.0.0.1:{api_port}", database["dsn"], home, client)
            _wait_until_ready(deployment)
            yield deployment
    finally:
        leftovers = services.stop()
        shutil.rmtree(pg_root, ignore_errors=True)
    if leftovers:
        raise RuntimeError(f"processes still running after the deployment stopped: {leftovers}")


def airflow_settings(home: Path, *, database: Mapping[str, str], broker: str, api_port: int) -> dict[str, str]:
    """The local Airflow's settings (:mod:`tasks.orchestration.local_airflow`) turned into a Celery deployment's."""
    from cryptography.fernet import Fernet

    settings = local_airflow.airflow_environment(home)
    settings.update(
        {
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database["sqlalchemy"],
            "AIRFLOW__CELERY__BROKER_URL": broker,
            "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{database['sqlalchemy'].replace('+psycopg2', '')}",
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "1",
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{api_port}",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{api_port}/execution/",
            # every component must share these (a real deployment keeps them in a secret)
            "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
        }
    )
    return settings


def start_postgres(services: Services, data: Path) -> dict[str, str]:
    """initdb into ``data`` (a new folder) and start PostgreSQL on a free loopback port, TCP only; create the DB.

    ``data``'s parent must be reachable by :data:`PG_USER` when the test runs as root.
    """
    data.mkdir()
    if os.geteuid() == 0:
        import pwd

        entry = pwd.getpwnam(PG_USER)
        os.chown(data, entry.pw_uid, entry.pw_gid)
    initdb = [str(PG_BIN / "initdb"), "-D", str(data), "-U", "airflow", "-A", "trust", "-E", "UTF8", "--no-locale"]
    services.run("initdb", initdb, _base_environment(), user=PG_USER, timeout=120)
    port = free_port()
    settings = ["-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=", "-c", "fsync=off"]
    services.start(
        "postgres",
        [str(PG_BIN / "postgres"), "-D", str(data), "-p", str(port), *settings],
        _base_environment(),
        user=PG_USER,
        stop_signal=signal.SIGINT,  # "fast" shutdown; SIGTERM waits for every client to disconnect
    )
    admin_dsn = f"host=127.0.0.1 port={port} user=airflow dbname=postgres"

    def create_database() -> bool:
        import psycopg2

        connection = psycopg2.connect(admin_dsn)
        try:
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute(f"CREATE DATABASE {DB_NAME}")
        finally:
            connection.close()
        return True

    services.wait_until("PostgreSQL", create_database, timeout=60, interval=0.5)
    return {
        "dsn": f"host=127.0.0.1 port={port} user=airflow dbname={DB_NAME}",
        "sqlalchemy": f"postgresql+psycopg2://airflow@127.0.0.1:{port}/{DB_NAME}",
    }


def start_redis(services: Services) -> str:
    """redis-server on a free loopback port, no persistence; returns the broker URL."""
    import redis

    port = free_port()
    argv = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    services.start("redis", argv, _base_environment(), cwd=services.log_dir)
    services.wait_until("Redis", lambda: redis.Redis(port=port).ping(), timeout=30, interval=0.5)
    return f"redis://127.0.0.1:{port}/0"


def _wait_until_ready(deployment: Deployment) -> None:
    """The API answers, the scheduler and DAG processor report healthy, both workers are up, the admin has a token."""

    def healthy() -> bool:
        health = deployment.client.get(f"{deployment.api_url}/api/v2/monitor/health").json()
        return all(health[part]["status"] == "healthy" for part in ("metadatabase", "scheduler", "dag_processor"))

    deployment.services.wait_until("scheduler and DAG processor healthy", healthy, timeout=STARTUP_TIMEOUT)
    for worker in WORKERS:
        log = deployment.services.log_dir / f"{worker}.log"
        deployment.services.wait_until(
            f"Celery worker {worker}",
            lambda log=log: re.search(r"@\S+ ready\.", log.read_text(errors="replace")) is not None,
            timeout=STARTUP_TIMEOUT,
        )
    user, password = local_airflow.LOGIN
    response = deployment.client.post(f"{deployment.api_url}/auth/token", json={"username": user, "password": password})
    response.raise_for_status()
    deployment.client.headers["Authorization"] = f"Bearer {response.json()['access_token']}"


def _base_environment() -> dict[str, str]:
    """This process's environment without AWS credentials (storage credentials live in an Airflow connection)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and not k.startswith("AIRFLOW")}
    bin_dir = str(Path(sys.executable).parent)
    environment["PATH"] = os.pathsep.join([bin_dir, environment.get("PATH", "")])
    environment["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(local_airflow.CHECKOUT), environment.get("PYTHONPATH", "")) if p
    )
    return environment
