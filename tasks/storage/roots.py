"""Storage roots: which URLs a root may be, whether it exists, and which batches it holds.

One place decides what a root URL may look like before anything is written (docs/operations.md,
"Storage roots"):

* :func:`check_url_form`, for every :class:`~tasks.storage.objects.ObjectStore`: refuses the URLs
  fsspec would silently read as a local path under the current directory (``s3:/bucket/runs``,
  ``s3:bucket``, ``file:/tmp/x``, ``file://tmp/x``), saying what was probably meant; ``file://localhost/``
  becomes ``file:///``. Any protocol fsspec can resolve passes (tests chain a fault injector);
* :func:`check_root_url`, for a root a person typed (the CLI's ``--root``, Airflow's ``storage_url``):
  that, and only the schemes of :func:`supported_schemes` (computed from what imports here);
* :func:`prepare_root` (plan: a missing root is created with the batch, never directly under ``/``,
  never a bucket), :func:`require_root` (every other command: a missing root is an error) and
  :func:`require_batch` (an unknown batch id lists the batches the root holds and the closest id).

Every refusal is a :class:`~tasks.errors.StorageRootError` or :class:`~tasks.errors.UnknownBatchError`
(usage errors, exit 2) whose message names the supported schemes.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import os
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from tasks import layout
from tasks.errors import StorageRootError, UnknownBatchError
from tasks.ids import is_id
from tasks.storage.options import aws_variables_read
from tasks.storage.retries import call_with_retries

if TYPE_CHECKING:
    from tasks.storage.objects import ObjectStore

LOCAL_SCHEMES = ("file", "local")
S3_SCHEMES = ("s3", "s3a")
# scheme -> the package its fsspec filesystem needs (None: fsspec's own)
KNOWN_SCHEMES: dict[str, str | None] = {"file": None, "local": None, "s3": "s3fs", "s3a": "s3fs", "memory": None}
LISTED_BATCHES = 8  # an unknown batch id's message names at most this many batches
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)", re.DOTALL)


# --- what a root URL may be -----------------------------------------------------------------------


@functools.cache
def supported_schemes() -> tuple[str, ...]:
    """The schemes a root may have here: ``file``/``local`` and ``memory`` always, ``s3``/``s3a`` when s3fs imports."""
    return tuple(scheme for scheme, package in KNOWN_SCHEMES.items() if package is None or _imports(package))


def supported_text() -> str:
    """The supported roots, as every storage error names them."""
    forms = {
        "file": "file:///absolute/path",
        "s3": "s3://bucket/prefix",
        "s3a": "s3a://bucket/prefix",
        "memory": "memory://name (tests, one process)",
    }
    listed = ["a local path", *(forms[s] for s in supported_schemes() if s in forms)]
    missing = "" if "s3" in supported_schemes() else " (s3:// needs s3fs, which does not import here)"
    return f"Supported storage roots: {', '.join(listed)}{missing}."


def check_url_form(url: str) -> str:
    """``url`` as a store opens it, refusing what fsspec would take for a local path though it looks like a URL.

    A chained URL (``a::b://...``) is checked on its target, the last link.
    """
    if not isinstance(url, str) or not url.strip():
        raise StorageRootError(f"the storage root is empty. {supported_text()}")
    chain, _, target = url.rpartition("::")
    checked = _check_target_form(target, shown=url)
    return f"{chain}::{checked}" if chain else checked


def check_root_url(url: str, *, connection_ids: bool = False) -> str:
    """A root a person gave, checked before anything is read or written, as stores should open it.

    On top of :func:`check_url_form`: only :func:`supported_schemes`, no chained URL, no credentials in the
    URL, and a connection id in an S3 URL (``s3://conn_id@bucket/prefix``) only where ``connection_ids``
    (Airflow's ``storage_url``). A local path starting with ``~`` is the home folder, as in a shell.
    """
    url = check_url_form(url)
    if "::" in url:
        raise StorageRootError(
            f"storage root {_shown(url)} chains filesystems, which is not supported. {_nothing_written()}"
        )
    match = _SCHEME.fullmatch(url)
    if match is None or not match.group(2).startswith("//"):  # a local path (check_url_form let it through)
        return os.path.expanduser(url) if url.startswith("~") else url
    scheme = match.group(1)
    if scheme not in supported_schemes():
        raise StorageRootError(_unsupported(url, scheme))
    parts = urlsplit(url)
    if parts.password is not None:
        raise StorageRootError(
            f"storage root {_shown(url)} carries credentials; give them to the process instead "
            f"(AWS variables, or an Airflow connection). {_nothing_written()}"
        )
    if parts.username is not None and not (connection_ids and scheme in S3_SCHEMES):
        raise StorageRootError(
            f"storage root {_shown(url)} names a user or connection ({parts.username}@): on the command line the "
            f"credentials come from the AWS variables, so write {scheme}://{parts.netloc.rpartition('@')[2]}"
            f"{parts.path}. {_nothing_written()}"
        )
    return url


def _check_target_form(url: str, *, shown: str) -> str:
    match = _SCHEME.fullmatch(url)
    if match is None:
        return url  # a local path
    scheme, rest = match.group(1), match.group(2)
    lowered = scheme.lower()
    if not rest.startswith("//"):
        if not _looks_like_scheme(lowered):
            return url  # a local name with a colon in it ("runs:v2")
        raise StorageRootError(f"storage root {_shown(shown)} is not a well-formed URL: {_meant(lowered, rest)}")
    authority, _, path = rest[2:].partition("/")
    if lowered in LOCAL_SCHEMES:
        if authority.lower() == "localhost":  # file://localhost/path is file:///path (RFC 8089)
            authority, url = "", f"{scheme}:///{path}"
        if authority:
            meant = "/".join(part for part in (authority, path.rstrip("/")) if part)
            raise StorageRootError(
                f"storage root {_shown(shown)} names the host {authority!r}: a file URL is file:///absolute/path "
                f"(three slashes); did you mean file:///{meant}? {_nothing_written()}"
            )
        if not path.strip("/"):
            raise StorageRootError(f"storage root {_shown(shown)} names no folder. {_nothing_written()}")
    if lowered in S3_SCHEMES and not authority.rpartition("@")[2]:
        guess = path.strip("/")
        meant = f"did you mean {lowered}://{guess}? " if guess else ""
        raise StorageRootError(
            f"storage root {_shown(shown)} names no bucket: an S3 root is {lowered}://bucket/prefix; {meant}"
            f"{_nothing_written()}"
        )
    return url


def _looks_like_scheme(word: str) -> bool:
    """Whether ``word:`` before a path reads as a URL scheme with its ``//`` missing."""
    import fsspec

    known = {*KNOWN_SCHEMES, *fsspec.available_protocols(), "http", "https"}
    return word in known or bool(difflib.get_close_matches(word, supported_schemes(), n=1, cutoff=0.7))


def _meant(scheme: str, rest: str) -> str:
    """``did you mean ...?`` for ``scheme:rest`` typed without ``//``."""
    if scheme in LOCAL_SCHEMES:
        absolute = rest.startswith("/")
        suggestion = f"file:///{rest.lstrip('/')}" if absolute else f"{rest} (a relative local path)"
        return f"a file URL is file:///absolute/path (three slashes); did you mean {suggestion}? {_nothing_written()}"
    return f"did you mean {scheme}://{rest.lstrip('/')}? {_nothing_written()}"


def _unsupported(url: str, scheme: str) -> str:
    """Why ``scheme`` cannot be a root here, with the scheme probably meant."""
    lowered = scheme.lower()
    rest = url.partition(":")[2]
    head = f"storage root {_shown(url)}: scheme {scheme!r} is not supported"
    if lowered in KNOWN_SCHEMES and lowered in supported_schemes():  # S3://, File://
        return f"{head}; did you mean {lowered}:{rest}? (schemes are lower case) {_nothing_written()}"
    if lowered in KNOWN_SCHEMES:  # s3 without s3fs
        return f"{head}: {lowered}:// needs {KNOWN_SCHEMES[lowered]}, which does not import here. {_nothing_written()}"
    close = difflib.get_close_matches(lowered, supported_schemes(), n=1, cutoff=0.6)
    if close:
        return f"{head}; did you mean {close[0]}:{rest}? {_nothing_written()}"
    why = "rollout-ledger writes its create-once objects only to local disk and S3"
    package = _package_of(lowered)
    if package is not None and importlib.util.find_spec(package) is None:
        why += f"; {lowered}:// would also need {package}, which is not installed"
    elif package is None:
        import fsspec

        typo = difflib.get_close_matches(lowered, fsspec.available_protocols(), n=1, cutoff=0.6)
        if typo:
            why = f"did you mean {typo[0]}://? {why}, not there either"
    return f"{head} ({why}). {_nothing_written()}"


def _package_of(scheme: str) -> str | None:
    """The top-level package of fsspec's implementation of ``scheme`` (None: not a scheme fsspec knows)."""
    from fsspec.registry import known_implementations

    known = known_implementations.get(scheme)
    return None if known is None else known["class"].split(".", 1)[0]


def _nothing_written() -> str:
    return f"Nothing was written. {supported_text()}"


def _shown(url: str) -> str:
    """``url`` quoted, with the password of any userinfo replaced by ``***`` (safe to print)."""
    try:
        parts = urlsplit(url)
        if parts.password is not None:
            url = parts._replace(netloc=f"***@{parts.hostname or ''}").geturl()
    except ValueError:
        pass
    return repr(url)


@functools.cache
def _imports(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


# --- whether a root and a batch exist -------------------------------------------------------------


def prepare_root(store: ObjectStore) -> bool:
    """For plan, before it writes: True when the root does not exist yet (writing the batch will create it).

    Refused (:class:`~tasks.errors.StorageRootError`): a local root whose first missing folder would be made
    directly under ``/``, a local root that is a file or under one, an S3 root whose bucket does not exist.
    """
    if store.is_local:
        return _prepare_local(store)
    if store.is_s3:
        _require_bucket(store, "plan does not create buckets; create it first, or fix the root")
    return not _exists(store, store.root)


def require_root(store: ObjectStore, command: str) -> None:
    """For every command but plan: the root exists, else :class:`~tasks.errors.StorageRootError` (nothing made)."""
    where = _display(store)
    if store.is_local and os.path.isfile(store.root):
        raise StorageRootError(f"storage root {where} is a file, not a folder. {supported_text()}")
    if store.is_s3:
        _require_bucket(store, f"{command} created nothing")
    if os.path.isdir(store.root) if store.is_local else _exists(store, store.root):
        return
    raise StorageRootError(
        f"no storage root {where}: it does not exist, and {command} created nothing (plan creates a root with "
        f"its first batch); check the root's spelling. {supported_text()}"
    )


def require_batch(root: ObjectStore, batch_id: str) -> None:
    """The batch ``batch_id`` is under ``root`` (which exists), else :class:`~tasks.errors.UnknownBatchError`
    listing the batches it holds and the closest id."""
    batch = layout.batch_dir(batch_id)
    if _exists(root, root.full_path(batch)):
        return
    batches = batch_ids(root)
    where = _display(root)
    if not batches:
        raise UnknownBatchError(
            f"no batch {batch_id!r} under {where}: it holds no batches yet; plan one with `rollout-ledger plan`"
        )
    close = difflib.get_close_matches(batch_id, batches, n=1, cutoff=0.6)
    meant = f"; did you mean {close[0]}?" if close else "."
    shown = ", ".join(batches[:LISTED_BATCHES])
    more = f" and {len(batches) - LISTED_BATCHES} more" if len(batches) > LISTED_BATCHES else ""
    noun = "batch" if len(batches) == 1 else "batches"
    raise UnknownBatchError(f"no batch {batch_id!r} under {where}{meant} It holds {len(batches)} {noun}: {shown}{more}")


def batch_ids(root: ObjectStore) -> list[str]:
    """The ids of the batches under ``root`` (its ``batches/`` folder), sorted."""
    folder = root.full_path(layout.BATCHES_DIR)

    def listed() -> list[str]:
        root.fs.invalidate_cache(folder)
        try:
            entries = root.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    names = call_with_retries(root.retry_policy, "list", f"{root.url}/{layout.BATCHES_DIR}", listed)
    return sorted({name for name in names if is_id(name)})


def _prepare_local(store: ObjectStore) -> bool:
    path = os.path.abspath(store.root)
    if os.path.isdir(path):
        return False
    if os.path.exists(path):
        raise StorageRootError(f"storage root {path} is a file, not a folder. {supported_text()}")
    top = path
    while not os.path.exists(os.path.dirname(top)):
        top = os.path.dirname(top)
    parent = os.path.dirname(top)
    if not os.path.isdir(parent):
        raise StorageRootError(f"storage root {path} is under {parent}, which is a file. {supported_text()}")
    if parent == os.path.dirname(parent):  # the top of the file system
        raise StorageRootError(top_level_refusal(path, top))
    return True


def top_level_refusal(path: str, top: str) -> str:
    """Why a folder is not made directly under ``/`` for ``path`` (``top`` is the one it would make)."""
    return (
        f"storage root {path} does not exist and would create {top} at the top of the file system, which "
        f"rollout-ledger never does (a mistyped path?); if you mean it, create it first (mkdir -p {path}) and run "
        f"again. Nothing was written. {supported_text()}"
    )


def _require_bucket(store: ObjectStore, what_then: str) -> None:
    bucket = store.root.split("/", 1)[0]
    if _exists(store, bucket):
        return
    read = aws_variables_read(os.environ)
    raise StorageRootError(
        f"no storage root {_display(store)}: bucket {bucket!r} does not exist or these credentials cannot see it "
        f"(AWS variables read: {', '.join(read) if read else 'none set'}); {what_then}. {supported_text()}"
    )


def _exists(store: ObjectStore, path: str) -> bool:
    def exists() -> bool:
        store.fs.invalidate_cache(path)
        return bool(store.fs.exists(path))

    return call_with_retries(store.retry_policy, "exists", path, exists)


def _display(store: ObjectStore) -> str:
    """The root as a person reads it: the absolute folder of a local root, else its URL."""
    return os.path.abspath(store.root) if store.is_local else store.url
