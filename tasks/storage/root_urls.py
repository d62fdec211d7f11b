"""Storage root URLs: which URLs a root may be, refused with what was probably meant (docs/operations.md).

* :func:`check_url_form`, for every :class:`~tasks.storage.objects.ObjectStore`: refuses the URLs
  fsspec would silently read as a local path under the current directory (``s3:/bucket/runs``,
  ``s3:bucket``, ``file:/tmp/x``, ``file://tmp/x``), saying what was probably meant; ``file://localhost/``
  becomes ``file:///``. Any protocol fsspec can resolve passes (tests chain a fault injector);
* :func:`check_root_url`, for a root a person typed (the CLI's ``--root``, Airflow's ``storage_url``):
  that, and only the schemes of :func:`supported_schemes` (computed from what imports here).

Every refusal is a :class:`~tasks.errors.StorageRootError` (a usage error, exit 2) whose message names
the supported schemes. Whether a root and a batch exist is :mod:`tasks.storage.roots`'s.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import os
import re
from urllib.parse import urlsplit

from tasks.errors import StorageRootError

LOCAL_SCHEMES = ("file", "local")
S3_SCHEMES = ("s3", "s3a")
# scheme -> the package its fsspec filesystem needs (None: fsspec's own)
KNOWN_SCHEMES: dict[str, str | None] = {"file": None, "local": None, "s3": "s3fs", "s3a": "s3fs", "memory": None}
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


def top_level_refusal(path: str, top: str) -> str:
    """Why a folder is not made directly under ``/`` for ``path`` (``top`` is the one it would make)."""
    return (
        f"storage root {path} does not exist and would create {top} at the top of the file system, which "
        f"rollout-ledger never does (a mistyped path?); if you mean it, create it first (mkdir -p {path}) and run "
        f"again. Nothing was written. {supported_text()}"
    )
