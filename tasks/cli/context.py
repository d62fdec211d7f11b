"""What a command reaches and tells: the batch on storage configured from the environment, the
lineage sink, and lines on stderr (stdout is the command's result)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from tasks.batch import Batch
from tasks.storage.options import storage_options_from_env

if TYPE_CHECKING:
    from tasks.lineage.emit import LineageSink


def open_batch(args: argparse.Namespace) -> Batch:
    """The batch the command names, on storage configured from the environment (AWS variables for S3)."""
    return Batch.open(args.root, args.batch_id, storage_options_from_env(args.root, os.environ))


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
