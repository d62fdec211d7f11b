"""Generate one shard in a child process: how a long-lived Airflow worker runs an engine cleanly.

The task process starts the generate worker for its shard (``python -m tasks.generate.worker``:
the library's generate run, its exit codes and signal handling: docs/architecture.md §10) and
streams the child's log lines into the task log. The child's command line and environment hold
no secret: the run's storage options and the servers' key reach it on its stdin, and it starts
without Airflow's own settings (docs/security.md, "Agents reach no credentials"). The engine
lives and dies with the child, so nothing of it outlives the task: on any exit of the task
(success, exception, Airflow's timeout or kill) the child is stopped with SIGTERM (it flushes the
receipts of completed rollouts and closes the engine) and killed if it does not stop within
:data:`STOP_GRACE_SECONDS`; if the task process itself dies, Linux sends the child SIGTERM
(``PR_SET_PDEATHSIG``, set by the child itself: no ``preexec_fn`` in a threaded parent).
``$ROLLOUT_LEDGER_GENERATE_PYTHON`` names the interpreter of a separate GPU environment (the
Docker image's); by default it is this one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.engines.vllm_server.options import API_KEY_ENV
from tasks.errors import EXIT_CODES, EXIT_CONFLICT, EXIT_SIGNAL_BASE, EXIT_USAGE
from tasks.orchestration.storage_location import StorageLocation
from tasks.storage.options import STORAGE_OPTIONS_VARIABLE

GENERATE_PYTHON_VARIABLE = "ROLLOUT_LEDGER_GENERATE_PYTHON"
STOP_GRACE_SECONDS = 120.0
WORKER_MODULE = "tasks.generate.worker"  # run as ``python -m``; imported only in the child
PERMANENT_EXIT_CODES = (EXIT_USAGE, EXIT_CONFLICT)  # the worker's exit codes that a retry cannot fix
AIRFLOW_PREFIXES = ("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_VAR_")  # Airflow's settings, connections, variables


class GenerateProcessError(RuntimeError):
    """The child exited non-zero; ``permanent`` when retrying the same command cannot succeed."""

    def __init__(self, returncode: int, message: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.permanent = returncode in PERMANENT_EXIT_CODES


LINEAGE_OFF = "OPENLINEAGE_DISABLED"


@dataclass(frozen=True)
class GenerateCommand:
    """One shard's generate run: what the child is told. Its argv and environment hold no secret: the storage
    options and ``secrets`` reach it on its stdin (:meth:`handed_over`), read once as it starts."""

    location: StorageLocation
    batch_id: str
    shard: int
    try_number: int | None = None
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False)  # e.g. the engine servers' API key
    servers: Sequence[str] = ()  # the run's servers connection's URLs: the only ones the key may go to
    models: Sequence[str] = ()  # the models the trigger policy lists besides the bundled one

    def argv(self, python: str) -> list[str]:
        argv = [python, "-m", WORKER_MODULE, "--root", self.location.root_url, "--batch-id", self.batch_id]
        argv += ["--shard", str(self.shard), "--secrets-on-stdin"]
        return argv + ([] if self.try_number is None else ["--try-number", str(self.try_number)])

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The child's variables: ``base`` without Airflow's own settings and secrets (:func:`kept_variable`), and
        lineage off (the task reports generate's datasets itself, in its own OpenLineage run)."""
        return {**{k: v for k, v in base.items() if kept_variable(k)}, LINEAGE_OFF: "true"}

    def handed_over(self) -> bytes:
        """What the child reads on its stdin, as one JSON object: the storage options, the secrets, and what the
        trigger policy lets the batch config on storage name (the run's servers, the listed models)."""
        policy = {"servers": list(self.servers), "models": list(self.models)}
        hand_over = {"storage_options": self.location.storage_options, "environment": dict(self.secrets)}
        return json.dumps({**hand_over, "trigger_policy": policy}).encode()


def kept_variable(name: str) -> bool:
    """Whether the generate child inherits variable ``name``: not Airflow's configuration, connections or
    variables (its database URL, Fernet key, secret key), nor a storage or server secret of this process
    (docs/security.md: the worker's initial environment holds none)."""
    return not name.startswith(AIRFLOW_PREFIXES) and name not in (STORAGE_OPTIONS_VARIABLE, API_KEY_ENV)


def generate_python(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(GENERATE_PYTHON_VARIABLE) or sys.executable


def run_generate(command: GenerateCommand, *, log: Callable[[str], Any], python: str | None = None) -> dict[str, Any]:
    """Run the shard in a child process and return its summary (the worker's JSON object for this shard).

    Raises :class:`GenerateProcessError` when the child fails; any exception raised while waiting
    (a timeout, a kill) stops the child first and then propagates.
    """
    process = subprocess.Popen(
        command.argv(python or generate_python()),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=command.environment(os.environ),
    )
    assert process.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # a child that died at once: its exit code says why
        process.stdin.write(command.handed_over().decode())
    with contextlib.suppress(BrokenPipeError):
        process.stdin.close()
    stderr_tail: list[str] = []
    pump = threading.Thread(target=_pump, args=(process.stderr, log, stderr_tail), daemon=True)
    pump.start()
    try:
        stdout = process.stdout.read() if process.stdout else ""
        returncode = process.wait()
    finally:
        stop(process, log=log)
        pump.join(timeout=5)
    if returncode != 0:
        why = (
            EXIT_CODES.get(returncode, "stopped by a signal")
            if returncode < EXIT_SIGNAL_BASE
            else "stopped by a signal"
        )
        last = stderr_tail[-1] if stderr_tail else "(no output)"
        raise GenerateProcessError(returncode, f"generate shard {command.shard} exited {returncode} ({why}): {last}")
    (summary,) = json.loads(stdout)
    return summary


def stop(process: subprocess.Popen, *, log: Callable[[str], Any], grace: float = STOP_GRACE_SECONDS) -> None:
    """Stop a child still running: SIGTERM, then SIGKILL after ``grace`` seconds (no-op once it has exited)."""
    if process.poll() is not None:
        return
    log(f"stopping generate (pid {process.pid}): SIGTERM, SIGKILL after {grace:.0f} s")
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _pump(stream: Any, log: Callable[[str], Any], tail: list[str]) -> None:
    for raw in stream:
        line = raw.rstrip("\n")
        log(line)
        tail[:] = [*tail[-19:], line]
