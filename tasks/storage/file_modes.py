"""The permission bits of what a store writes on local disk: objects and the folders made for them.

Published objects are meant to be read by others (a trainer, a web server, another user of the
machine), so a local write follows the process umask, as ``open`` and ``mkdir`` do: objects get
``0666 & ~umask``, folders ``0777 & ~umask`` (0644 and 0755 under the usual umask 022). A write's
temp file is created 0600 (``mkstemp``) and given its final mode before it is linked into place, so
no reader ever sees an object with other bits.

``$ROLLOUT_LEDGER_FILE_MODE`` (octal: ``0640``, ``640`` or ``0o640``) sets the objects' mode whatever
the umask; folders then get the same bits plus search (x) wherever they grant read (``0640``:
folders ``0750``). It must let the owner read and write (a store reads back what it wrote) and set
nothing beyond ``0777``; anything else is refused as a usage error before a store writes.

S3 and other object stores have no such bits: the variable is ignored there. Secrets never go
through a store (the server key ``rollout-ledger serve`` makes is written 0600 on its own,
:mod:`tasks.engines.vllm_server.serving.keys`).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass

FILE_MODE_VARIABLE = "ROLLOUT_LEDGER_FILE_MODE"
_OCTAL = re.compile(r"(?:0o?)?([0-7]{1,4})", re.IGNORECASE)
_OWNER_READ_WRITE = 0o600
_umask_lock = threading.Lock()


@dataclass(frozen=True)
class LocalModes:
    """``file``: an object's mode; ``folder``: a created folder's mode, or None for ``mkdir``'s own (umask)."""

    file: int
    folder: int | None


def local_modes(environ: Mapping[str, str] | None = None) -> LocalModes:
    """The modes of a local write now: ``$ROLLOUT_LEDGER_FILE_MODE`` when set, else the process umask's."""
    environ = os.environ if environ is None else environ
    text = environ.get(FILE_MODE_VARIABLE, "").strip()
    if text:
        mode = parse_file_mode(text)
        return LocalModes(file=mode, folder=mode | ((mode & 0o444) >> 2))
    return LocalModes(file=0o666 & ~current_umask(), folder=None)


def parse_file_mode(text: str) -> int:
    """The mode ``$ROLLOUT_LEDGER_FILE_MODE`` gives; :class:`~tasks.errors.ConfigError` naming it otherwise."""
    from tasks.errors import ConfigError

    match = _OCTAL.fullmatch(text.strip())
    mode = int(match.group(1), 8) if match else None
    if mode is None or mode > 0o777 or mode & _OWNER_READ_WRITE != _OWNER_READ_WRITE:
        raise ConfigError(
            f"${FILE_MODE_VARIABLE} must be an octal file mode of at most 0777 that lets the owner read and write "
            f"(0600, 0640, 0644, ...), got {text!r}; unset it to follow the umask"
        )
    return mode


def current_umask() -> int:
    """The process umask, read without changing it where Linux tells it (``/proc/self/status``).

    Elsewhere it is set and restored under a lock (``os.umask`` has no read-only form), which only this
    module's readers honour.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask
