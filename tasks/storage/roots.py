"""Storage roots: whether a root and a batch exist, and which batches a root holds (docs/operations.md).

What a root URL may be is :mod:`tasks.storage.root_urls`'s. Here: :func:`prepare_root` (plan: a
missing root is created with the batch, never directly under ``/``, never a bucket),
:func:`require_root` (every other command: a missing root is an error) and :func:`require_batch`
(an unknown batch id lists the batches the root holds and the closest id).

Every refusal is a :class:`~tasks.errors.StorageRootError` or :class:`~tasks.errors.UnknownBatchError`
(usage errors, exit 2) whose message names the supported schemes.
"""

from __future__ import annotations

import difflib
import os

from tasks import layout
from tasks.errors import StorageRootError, UnknownBatchError
from tasks.ids import is_id
from tasks.storage.objects import ObjectStore
from tasks.storage.options import aws_variables_read
from tasks.storage.retries import call_with_retries
from tasks.storage.root_urls import supported_text, top_level_refusal

LISTED_BATCHES = 8  # an unknown batch id's message names at most this many batches


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
