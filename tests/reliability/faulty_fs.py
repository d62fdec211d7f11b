"""A FAULT INJECTOR for tests: an fsspec filesystem that wraps a real one and fails a chosen fraction of its operations.

It chains in front of any fsspec URL, so the stage functions run over it unchanged::

    injector = FaultInjector([FaultRule(rate=0.1)], seed=7)
    url = faulty_url("s3://bucket/runs")                    # "faulty::s3://bucket/runs"
    options = faulty_options(injector, retry={"initial_wait_s": 0.001})

Every operation is one of :data:`OPERATIONS` (``read``: ``cat_file`` and reads through ``open``;
``write``: a file written through ``open``, ``pipe_file``, ``link``, ``mv``; ``list``: ``find``,
``ls``; ``exists``; ``info``: ``info``, ``size``, ``modified``; ``delete``: ``rm_file``). The
first :class:`FaultRule` that matches an operation (its kind and a glob on the path) decides,
with the injector's seeded RNG, whether it fails and how (:data:`FAULT_KINDS`):

* ``connection_reset``: ``ConnectionResetError``; nothing reached the target;
* ``slow_down``: ``OSError(EBUSY)``, what s3fs raises for S3's 503 SlowDown;
* ``internal_error``: ``OSError(EREMOTEIO)``, what s3fs raises for S3's 500 InternalError;
* ``timeout``: a short stall, then ``TimeoutError``; nothing reached the target;
* ``lost_response``: the operation happens on the target, then ``TimeoutError``: the caller
  cannot know that it did (a write that landed, a delete that happened);
* ``partial_write`` (file writes only): part of the bytes reach the target's file, then
  ``ConnectionResetError``;
* ``unavailable``: ``ConnectionRefusedError``: the store is gone (for outages: ``rate=1.0``).

The wrapper answers to its target's protocol names too, so ``ObjectStore`` picks the target's
create-once recipe (temp file and ``link`` on local disk, ``If-None-Match`` on S3) and runs it
through the wrapper. Every injected fault is counted by kind and by operation.
"""

from __future__ import annotations

import errno
import fnmatch
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.chained import ChainedFileSystem

from tasks.storage.objects import abandon
from tasks.storage.options import RETRY_OPTION

T = TypeVar("T")
PROTOCOL = "faulty"
OPERATIONS = frozenset({"read", "write", "list", "exists", "info", "delete"})
TRANSIENT_KINDS = ("connection_reset", "slow_down", "internal_error", "timeout", "lost_response", "partial_write")
FAULT_KINDS = (*TRANSIENT_KINDS, "unavailable")
STALL_SECONDS = 0.002  # how long a `timeout` fault hangs before it raises


@dataclass(frozen=True)
class FaultRule:
    """Which operations fail: a ``rate`` of those of ``operations`` whose path matches the glob ``match``,
    after the first ``after`` of them passed (a store that goes away mid-batch), with one of ``kinds``."""

    rate: float
    operations: frozenset[str] = OPERATIONS
    kinds: tuple[str, ...] = TRANSIENT_KINDS
    match: str = "*"
    after: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")
        if not self.operations <= OPERATIONS or not set(self.kinds) <= set(FAULT_KINDS) or not self.kinds:
            raise ValueError(f"unknown operations or kinds in {self}")


class FaultInjector:
    """Decides, with a seeded RNG, which operations fail; counts what it injected. Thread-safe."""

    def __init__(self, rules: Sequence[FaultRule], *, seed: int) -> None:
        self.rules = tuple(rules)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._eligible = Counter[int]()
        self.operations = Counter[str]()  # every operation seen, by kind of operation
        self.faults = Counter[str]()  # injected faults, by fault kind
        self.faults_by_operation = Counter[str]()

    def decide(self, operation: str, path: str, *, file_write: bool = False) -> str | None:
        """The fault kind this ``operation`` on ``path`` suffers, or None; ``partial_write`` only for a file write."""
        with self._lock:
            self.operations[operation] += 1
            for index, rule in enumerate(self.rules):
                if operation not in rule.operations or not fnmatch.fnmatchcase(path, rule.match):
                    continue
                self._eligible[index] += 1
                if self._eligible[index] <= rule.after or self._rng.random() >= rule.rate:
                    return None
                kinds = [k for k in rule.kinds if file_write or k != "partial_write"]
                if not kinds:
                    return None
                kind = self._rng.choice(kinds)
                self.faults[kind] += 1
                self.faults_by_operation[operation] += 1
                return kind
            return None

    def total(self) -> int:
        return sum(self.faults.values())


def raise_before(kind: str, operation: str, path: str) -> None:
    """Raise the error of a fault that strikes before the operation reaches the target (no-op for the others)."""
    where = f"fault injector: {operation} {path}"
    if kind == "connection_reset":
        raise ConnectionResetError(errno.ECONNRESET, f"{where}: connection reset by peer")
    if kind == "slow_down":
        raise OSError(errno.EBUSY, f"{where}: SlowDown (503): please reduce your request rate")
    if kind == "internal_error":
        raise OSError(errno.EREMOTEIO, f"{where}: InternalError (500): we encountered an internal error")
    if kind == "timeout":
        time.sleep(STALL_SECONDS)
        raise TimeoutError(f"{where}: timed out")
    if kind == "unavailable":
        raise ConnectionRefusedError(errno.ECONNREFUSED, f"{where}: connection refused")


def lost_response(operation: str, path: str) -> TimeoutError:
    return TimeoutError(f"fault injector: {operation} {path}: timed out waiting for the answer (it landed)")


class FaultInjectingFileSystem(ChainedFileSystem):
    """The target filesystem behind a :class:`FaultInjector`; see the module docstring."""

    protocol = PROTOCOL
    cachable = False

    def __init__(
        self,
        injector: FaultInjector,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fs: fsspec.AbstractFileSystem | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.injector = injector
        self.target = fs or fsspec.filesystem(target_protocol, **(target_options or {}))
        target = self.target.protocol
        self.protocol = (PROTOCOL, *((target,) if isinstance(target, str) else target))

    def _faulty(self, operation: str, path: str, action: Callable[[], T]) -> T:
        kind = self.injector.decide(operation, path)
        if kind is not None:
            raise_before(kind, operation, path)
        result = action()
        if kind == "lost_response":
            raise lost_response(operation, path)
        return result

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        return self._faulty("read", path, lambda: self.target.cat_file(path, start=start, end=end, **kwargs))

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self._faulty("write", path, lambda: self.target.pipe_file(path, value, mode=mode, **kwargs))

    def link(self, src: str, dst: str, **kwargs: Any) -> None:
        self._faulty("write", dst, lambda: self.target.link(src, dst, **kwargs))

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self._faulty("write", path2, lambda: self.target.mv(path1, path2, **kwargs))

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._faulty("list", path, lambda: self.target.find(path, *args, **kwargs))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._faulty("list", path, lambda: self.target.ls(path, detail=detail, **kwargs))

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self._faulty("exists", path, lambda: self.target.exists(path, **kwargs))

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._faulty("info", path, lambda: self.target.info(path, **kwargs))

    def size(self, path: str) -> int:
        return self._faulty("info", path, lambda: self.target.size(path))

    def modified(self, path: str) -> Any:
        return self._faulty("info", path, lambda: self.target.modified(path))

    def rm_file(self, path: str) -> None:
        self._faulty("delete", path, lambda: self.target.rm_file(path))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.target.makedirs(path, exist_ok=exist_ok)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.target.invalidate_cache(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            return self._faulty("read", path, lambda: self.target.open(path, mode, **kwargs))
        kind = self.injector.decide("write", path, file_write=True)
        if kind is not None:
            raise_before(kind, "write", path)
        return FaultyWriteFile(self.target.open(path, mode, **kwargs), kind, path)


class FaultyWriteFile:
    """The target's file being written, failing as its fault says: part of the bytes then an error
    (``partial_write``), or the commit landing and its answer lost (``lost_response``)."""

    def __init__(self, target: Any, fault: str | None, path: str) -> None:
        self.target = target
        self.fault = fault
        self.path = path

    def write(self, data: bytes) -> int:
        if self.fault == "partial_write":
            self.target.write(data[: len(data) // 2])
            raise ConnectionResetError(errno.ECONNRESET, f"fault injector: write {self.path}: reset mid-write")
        return self.target.write(data)

    def flush(self) -> None:
        self.target.flush()

    def fileno(self) -> int:
        return self.target.fileno()

    @property
    def closed(self) -> bool:
        return self.target.closed

    def discard(self) -> None:
        abandon(self.target)

    def close(self) -> None:
        if self.target.closed:
            return
        self.target.close()
        if self.fault == "lost_response":
            raise lost_response("write", self.path)

    def __enter__(self) -> FaultyWriteFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


fsspec.register_implementation(PROTOCOL, FaultInjectingFileSystem, clobber=True)


def faulty_url(url: str) -> str:
    """``url`` behind the fault injector (fsspec URL chaining); a plain path becomes a ``file://`` URL."""
    return f"{PROTOCOL}::{url if '://' in url else 'file://' + url}"


def faulty_options(
    injector: FaultInjector, *, retry: dict[str, Any] | None = None, **target_options: Any
) -> dict[str, Any]:
    """Storage options for a :func:`faulty_url`: the injector, the retry settings, and the target's options."""
    options: dict[str, Any] = {PROTOCOL: {"injector": injector}, **target_options}
    if retry is not None:
        options[RETRY_OPTION] = retry
    return options
