"""What every rollout-ledger process does alike at its edges: logging, and the exit code and line of an error.

The ``rollout-ledger`` CLI (:mod:`tasks.cli`) and the generate worker (:mod:`tasks.generate.worker`)
run their command through :func:`run_command`; the Airflow steps quote :func:`classify_error`'s
line when they fail a task without retries. An error's exit code is its own
(:func:`tasks.errors.exit_code`), except that an error reaching storage that is not ours (a
missing bucket, no credentials) is the user's setup: a usage error. A person sees one line, never
a traceback (unless ``verbose``), and for an S3 root the names, never the values, of the storage
variables that were read.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from tasks.errors import (
    EXIT_FAILED,
    EXIT_USAGE,
    ConflictError,
    EngineDeadError,
    GenerateInterrupted,
    RefusedError,
    StorageUnavailableError,
    UsageError,
    exit_code,
)
from tasks.storage.options import aws_variables_read, is_s3_url
from tasks.storage.root_urls import supported_text

QUIET_LIBRARIES = ("great_expectations", "httpx")  # they narrate their internals at INFO
log = logging.getLogger("rollout_ledger")


def configure_logging(*, verbose: bool) -> None:
    """Log lines on stderr: DEBUG with ``verbose``, else INFO with :data:`QUIET_LIBRARIES` at WARNING."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)


def run_command(command: str, root: str | None, body: Callable[[], int], *, verbose: bool) -> int:
    """``body()``'s exit code; an error (or Ctrl-C) becomes :func:`classify_error`'s code and line on stderr."""
    try:
        return body()
    except (Exception, KeyboardInterrupt) as exc:
        code, message = classify_error(exc, command, root)
        if code == EXIT_FAILED and verbose:
            log.exception("rollout-ledger %s failed", command)
        print(message, file=sys.stderr)
        return code


def classify_error(exc: BaseException, command: str, root: str | None) -> tuple[int, str]:
    """The exit code and the one line a person sees for an error of ``command`` (no traceback)."""
    prefix = f"rollout-ledger {command}"
    code = exit_code(exc)
    if isinstance(exc, GenerateInterrupted):
        return code, f"{prefix}: {exc}"
    if isinstance(exc, KeyboardInterrupt):
        return code, f"{prefix}: interrupted; nothing was committed by this run"
    if isinstance(exc, EngineDeadError) and command != "generate":  # plan's or refit's call to a server
        return code, f"{prefix}: failed: {exc}"
    if isinstance(exc, EngineDeadError):
        return code, (
            f"{prefix}: failed: the engine died ({exc}); receipts of completed rollouts were flushed and no "
            "shard marker was written: run generate again to adopt them and re-run the rest"
        )
    if isinstance(exc, RefusedError):
        return code, f"{prefix}: {exc}"
    if isinstance(exc, UsageError) or code == EXIT_USAGE:
        return code, f"{prefix}: error: {exc}"
    if isinstance(exc, ConflictError):
        return code, f"{prefix}: conflict: {exc}"
    if isinstance(exc, StorageUnavailableError):  # transient faults outlasted the retries: retry the command later
        return code, f"{prefix}: failed: {exc}{_where(root)}"
    if root is not None and (_is_storage_access_error(exc) or _is_unknown_protocol(exc)):
        return EXIT_USAGE, (
            f"{prefix}: error: cannot use storage {root}{_where(root)}: {type(exc).__name__}: {exc}. {supported_text()}"
        )
    return EXIT_FAILED, f"{prefix}: failed: {type(exc).__name__}: {exc} (-v shows the traceback)"


def _where(root: str | None) -> str:
    """For an S3 root, which storage variables were read (names, never values); else nothing."""
    if root is None or not is_s3_url(root):
        return ""
    read = aws_variables_read(os.environ)
    return f" (AWS variables read: {', '.join(read) if read else 'none set'})"


def _is_unknown_protocol(exc: BaseException) -> bool:
    """fsspec's answer to a scheme it does not know or cannot import (what
    :func:`tasks.storage.root_urls.check_root_url` refuses first, for a root given on the command line)."""
    return (isinstance(exc, ValueError) and str(exc).startswith("Protocol not known")) or (
        isinstance(exc, ImportError) and type(exc).__module__ == "builtins" and "fsspec" in _origin(exc)
    )


def _origin(exc: BaseException) -> str:
    """The module the innermost frame of ``exc``'s traceback ran in."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return "" if tb is None else str(tb.tb_frame.f_globals.get("__name__", ""))


def _is_storage_access_error(exc: BaseException) -> bool:
    """Errors reaching storage (missing bucket, no credentials, endpoint down): the user's setup, not a bug."""
    module = type(exc).__module__
    return isinstance(exc, (PermissionError, FileNotFoundError, ConnectionError, TimeoutError)) or module.startswith(
        ("botocore", "aiobotocore", "s3fs")
    )
