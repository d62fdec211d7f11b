"""Create-once objects on any fsspec URL (docs/architecture.md §2).

Every object is written exactly once. A second write of the same name with the same bytes
is a no-op; with different bytes it raises :class:`ObjectConflictError` (a
``FileExistsError``) and leaves the first object untouched. Two racing writers: exactly one
wins and readers never see a torn object.

* local disk: temp file in the target directory, given its final mode (the umask's ``0666 & ~umask``
  or ``$ROLLOUT_LEDGER_FILE_MODE``: :mod:`tasks.storage.file_modes`), fsync, ``os.link`` to the final
  name (fails if it exists, unlike rename), unlink the temp, fsync the directory; a folder is never
  made directly under ``/``;
* S3: ``If-None-Match: *`` on the single PUT or on CompleteMultipartUpload (s3fs mode ``xb``);
* other filesystems (``memory://`` in tests): the filesystem's own ``xb`` mode.

A write that fails leaves no object behind: the local temp file is removed, and an S3 upload is
discarded (a multipart upload aborted), never completed with the bytes it had so far. Every
operation is retried on transient errors (:mod:`tasks.storage.retries`); a retried write keeps the
create-once contract, since a write that landed before its answer was lost re-writes as a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

import fsspec
from fsspec.spec import AbstractBufferedFile

from tasks.crash_points import crash_point
from tasks.errors import ObjectConflictError, StorageRootError
from tasks.storage.file_modes import LocalModes, local_modes
from tasks.storage.options import RETRY_OPTION, is_s3_url, retry_settings, with_s3_defaults
from tasks.storage.retries import RetryPolicy, call_with_retries
from tasks.storage.root_urls import check_url_form, top_level_refusal

SCHEMES_LOCAL = ("file", "local")
# A local write's temp file, next to its target; it lives for the milliseconds of one write.
TEMP_PREFIX, TEMP_SUFFIX = ".tmp-", ".part"
T = TypeVar("T")


@dataclass(frozen=True)
class WrittenObject:
    """Where an object landed and what it holds; ``created`` is False for an identical re-write."""

    path: str
    size: int
    sha256: str
    created: bool


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ObjectStore:
    """A root URL on any fsspec filesystem; paths given to it are relative to that root.

    Relative paths use ``/`` and may not contain ``..`` or empty parts, so nothing is written
    outside the root. S3 settings come from the standard AWS environment variables unless
    ``storage_options`` says otherwise. The storage option :data:`RETRY_OPTION` (else
    ``$ROLLOUT_LEDGER_STORAGE_RETRY``) sets the :class:`RetryPolicy` of every operation; the
    other options go to fsspec. On S3, listings are not cached (``use_listings_cache`` False unless
    given): other processes write the same prefixes, and a marker another task committed must be
    seen at once, not after a cached listing of its folder expires. On S3 the policy is the only
    retry loop: botocore makes one attempt per call with a short connect timeout unless
    ``config_kwargs`` says otherwise (:func:`~tasks.storage.options.with_s3_defaults`), and s3fs
    tries each call once. A URL fsspec would read as a local path though it looks like one
    (``s3:/bucket``, ``file://host/path``) is refused (:func:`~tasks.storage.root_urls.check_url_form`);
    on local disk, ``$ROLLOUT_LEDGER_FILE_MODE`` is checked here, before anything is written.
    """

    def __init__(self, url: str, *, block_size: int | None = None, **storage_options: Any) -> None:
        url = check_url_form(url)
        self.retry_policy = RetryPolicy.of(retry_settings(storage_options.pop(RETRY_OPTION, None), os.environ))
        if is_s3_url(url):
            storage_options.setdefault("use_listings_cache", False)
            storage_options = with_s3_defaults(storage_options)
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.fs: fsspec.AbstractFileSystem = fs
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")
        self.block_size = block_size
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        self.is_local = any(p in SCHEMES_LOCAL for p in protocols)
        self.is_s3 = any(p in ("s3", "s3a") for p in protocols)
        if self.is_s3:
            fs.retries = 1  # s3fs's own loop around each call (5 tries by default): the policy is the only one
        if self.is_local:
            local_modes()  # a malformed $ROLLOUT_LEDGER_FILE_MODE is refused before the first write

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def child(self, relative: str) -> ObjectStore:
        """A store rooted at ``relative`` below this one, on the same filesystem."""
        store = object.__new__(ObjectStore)
        store.__dict__.update(self.__dict__)
        store.root = self.full_path(relative)
        store.url = f"{self.url}/{_check_relative(relative)}"
        return store

    def full_path(self, relative: str) -> str:
        return f"{self.root}/{_check_relative(relative)}"

    # --- writes ---------------------------------------------------------------------------

    def write_once(self, relative: str, data: bytes) -> WrittenObject:
        """Create ``relative`` with ``data`` unless it exists; see the module docstring."""
        path = self.full_path(relative)
        digest = sha256_hex(data)
        create = self._link_local if self.is_local else self._write_exclusive
        created = self._retried("write", relative, lambda: create(path, data))
        if not created:
            existing = self.read_bytes(relative)
            if existing != data:
                raise ObjectConflictError(
                    f"{self.url}/{relative} already exists with different content "
                    f"({len(existing)} bytes, sha256 {sha256_hex(existing)[:12]}; "
                    f"refusing {len(data)} bytes, sha256 {digest[:12]})"
                )
        return WrittenObject(path=relative, size=len(data), sha256=digest, created=created)

    def replace(self, relative: str, data: bytes) -> None:
        """Write ``relative`` whole, replacing what is there: a reader sees the old bytes or the new.

        Only for what is rewritten by design (the report overview page); every other object is
        written once with :meth:`write_once`.
        """
        path = self.full_path(relative)
        if self.is_local:
            self._retried("replace", relative, lambda: self._rename_local(path, data))
        else:
            self._retried("replace", relative, lambda: self.fs.pipe_file(path, data))  # one whole-object PUT on S3

    def _link_local(self, path: str, data: bytes) -> bool:
        def link(temp: str) -> bool:
            try:
                self.fs.link(temp, path)
            except FileExistsError:
                return False
            return True

        return self._through_temp_local(path, data, link)

    def _rename_local(self, path: str, data: bytes) -> None:
        def rename(temp: str) -> bool:
            self.fs.mv(temp, path)
            return True

        self._through_temp_local(path, data, rename)

    def _through_temp_local(self, path: str, data: bytes, place: Callable[[str], bool]) -> bool:
        """Write ``data`` durably to a temp file beside ``path``, then ``place`` it there (False: not placed).

        The temp file goes whatever happens; the directory is fsynced once something was placed.
        """
        directory = os.path.dirname(path)
        modes = local_modes()
        _makedirs_durable(directory, modes)
        temp = _temp_file(directory, modes.file)
        try:
            with self.fs.open(temp, "wb") as handle:
                _write_durably(handle, data)
                crash_point("object_write", path)
            placed = place(temp)
        finally:
            _remove_temp(temp)
        if placed:
            _fsync_dir(directory)
        return placed

    def _write_exclusive(self, path: str, data: bytes) -> bool:
        """One exclusive create: the upload is committed by ``close``, and discarded if writing it failed.

        S3 answers a conditional write racing another one with 409 ConditionalRequestConflict
        (s3fs: ``OSError(EIO)``), a transient error the retry policy tries again; the loser then sees 412.
        """
        if not self.is_s3:
            self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        options = {"block_size": self.block_size} if self.block_size else {}
        try:
            handle = self.fs.open(path, "xb", **options)
            try:
                handle.write(data)
                crash_point("object_write", path)
            except BaseException:
                abandon(handle)
                raise
            handle.close()
        except FileExistsError:
            return False
        except (NotImplementedError, ValueError) as exc:
            if "x" in str(exc) or isinstance(exc, NotImplementedError):
                raise NotImplementedError(
                    f"{type(self.fs).__name__} cannot create objects exclusively ({exc}); "
                    "rollout-ledger needs local disk, S3, or a filesystem with mode 'xb'"
                ) from exc
            raise
        return True

    # --- reads ---------------------------------------------------------------------------

    def read_bytes(self, relative: str) -> bytes:
        path = self.full_path(relative)
        return self._retried("read", relative, lambda: self.fs.cat_file(path))

    def exists(self, relative: str) -> bool:
        path = self.full_path(relative)
        return self._retried("exists", relative, lambda: self.fs.exists(path))

    def size(self, relative: str) -> int:
        path = self.full_path(relative)
        return self._retried("info", relative, lambda: int(self.fs.size(path)))

    def list_files(self, relative: str = "") -> list[str]:
        """Every object below ``relative`` (recursive), as sorted paths relative to the root."""
        return self._retried("list", relative, lambda: self._list(relative))

    def _list(self, relative: str) -> list[str]:
        base = self.full_path(relative) if relative else self.root
        self.fs.invalidate_cache(base)
        if not self.fs.exists(base):
            return []
        prefix = self.root.rstrip("/") + "/"
        found = []
        for listed in self.fs.find(base):
            path = listed if listed.startswith("/") or not self.root.startswith("/") else "/" + listed
            if not path.startswith(prefix):
                raise RuntimeError(f"listing {base} returned {path}, outside {self.root}")
            found.append(path[len(prefix) :])
        return sorted(found)

    def modified_at(self, relative: str) -> float:
        """Seconds since the epoch when ``relative`` was last written."""
        path = self.full_path(relative)
        return self._retried("info", relative, lambda: self.fs.modified(path).timestamp())

    def delete(self, relative: str) -> None:
        """Delete ``relative``; FileNotFoundError when it is absent (also when a retried delete had landed)."""
        path = self.full_path(relative)
        self._retried("delete", relative, lambda: self.fs.rm_file(path))

    def _retried(self, operation: str, relative: str, action: Callable[[], T]) -> T:
        where = f"{self.url}/{relative}" if relative else self.url
        return call_with_retries(self.retry_policy, operation, where, action)


def abandon(handle: BinaryIO) -> None:
    """Throw away a file being written, uncommitted: fsspec's ``discard`` (s3fs aborts a multipart
    upload), then closed, so neither ``close`` nor garbage collection commits what it holds."""
    handle.discard()  # type: ignore[attr-defined]
    if isinstance(handle, AbstractBufferedFile):
        handle.closed = True


def is_temp_file(relative: str) -> bool:
    """Whether ``relative`` names the temp file of a local write (complete objects never do)."""
    name = relative.rsplit("/", 1)[-1]
    return name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)


def _check_relative(relative: str) -> str:
    if not isinstance(relative, str) or not relative:
        raise ValueError(f"object path must be a non-empty str, got {relative!r}")
    parts = relative.split("/")
    if relative.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"object path {relative!r} must be relative, without '', '.' or '..' parts")
    return relative


def _temp_file(directory: str, mode: int) -> str:
    """A new empty temp file of ``mode`` in ``directory`` that only this write knows the name of (``mkstemp``
    makes it 0600; the object linked from it keeps ``mode``)."""
    fd, temp = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return temp


def _write_durably(handle: BinaryIO, data: bytes) -> None:
    handle.write(data)
    handle.flush()
    os.fsync(handle.fileno())


def _remove_temp(temp: str) -> None:
    """Remove a local write's own temp file (gone already once renamed into place)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)


def _makedirs_durable(directory: str, modes: LocalModes) -> None:
    """Create ``directory`` (folders of ``modes.folder``, else the umask's) and fsync the parent of every directory
    created; never a folder directly under ``/`` (:class:`~tasks.errors.StorageRootError`)."""
    missing = []
    current = directory
    while not os.path.isdir(current):
        missing.append(current)
        current = os.path.dirname(current)
    if not missing:
        return
    top = missing[-1]
    if os.path.dirname(top) == os.path.dirname(os.path.dirname(top)):
        raise StorageRootError(top_level_refusal(directory, top))
    os.makedirs(directory, exist_ok=True)
    for created in reversed(missing):
        if modes.folder is not None:
            os.chmod(created, modes.folder)
        _fsync_dir(os.path.dirname(created))


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
