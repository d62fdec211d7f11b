"""What a command reaches and tells: the batch on storage configured from the environment, the
lineage sink, and lines on stderr (stdout is the command's result)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from tasks.batch import Batch
from tasks.storage.options import storage_options_from_env
from tasks.storage.root_urls import check_root_url
from tasks.storage.roots import prepare_root, require_batch, require_root

if TYPE_CHECKING:
    from tasks.lineage.emit import LineageSink


def open_batch(args: argparse.Namespace) -> Batch:
    """The batch the command names, on storage configured from the environment (AWS variables for S3).

    Before anything is read or written: the root is a well-formed URL of a supported scheme, or a local path
    (:func:`~tasks.storage.root_urls.check_root_url`), it exists, and it holds the batch (else the error lists
    the batches it holds). Plan opens its batch with :func:`open_new_batch` instead.
    """
    batch = _open(args)
    require_root(batch.root_store, getattr(args, "command", None) or "this command")
    require_batch(batch.root_store, args.batch_id)
    return batch


def open_new_batch(args: argparse.Namespace) -> tuple[Batch, bool]:
    """Plan's batch, and whether its root is new: a missing root is created by the batch's first write (never
    directly under ``/``, never an S3 bucket: :func:`~tasks.storage.roots.prepare_root`)."""
    batch = _open(args)
    return batch, prepare_root(batch.root_store)


def _open(args: argparse.Namespace) -> Batch:
    root = check_root_url(args.root)
    return Batch.open(root, args.batch_id, storage_options_from_env(root, os.environ))


def lineage_sink() -> LineageSink:
    """Where this command's task runs report their lineage (nothing unless OpenLineage is configured)."""
    from tasks.lineage.emit import sink_from_environment

    return sink_from_environment()


def say_lineage(sink: LineageSink) -> None:
    said = sink.describe()
    if said is not None:
        say(said)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
