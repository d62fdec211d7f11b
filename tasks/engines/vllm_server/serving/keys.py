"""The API key of a ``rollout-ledger serve`` server, when ``serve`` makes one itself.

``serve`` makes a key only for a loopback server (:func:`is_loopback`); any other host needs a
key file its clients share. A made key lives in a file of mode 0600 in a folder of mode 0700
(:func:`write_new_key`), replaced atomically, and is never printed: clients read the file.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import tempfile
from pathlib import Path

from tasks.models.bundled import cache_dir

KEY_ENV = "VLLM_API_KEY"  # where the server process reads its key (vLLM's own variable)
# The value of ``--middleware`` that installs the key guard (``server_argv`` passes it): named here,
# not imported, so launching a server imports no Starlette (``serving/auth.py`` runs inside vLLM).
MIDDLEWARE_PATH = "tasks.engines.vllm_server.serving.auth.RequireKey"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``localhost`` or a loopback address (any other name is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def generated_key_path(port: int) -> Path:
    """Where ``serve`` without a key file keeps the key it made for ``port``: ``<cache>/serve/port-<port>.key``."""
    return cache_dir() / "serve" / f"port-{port}.key"


def write_new_key(path: Path) -> str:
    """Write a new random key to ``path`` (mode 0600, replaced atomically: a reader sees the old or the new key) and
    return it; a folder it creates is mode 0700."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp: mode 0600
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(key + "\n")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return key
