"""Files a batch reads its tasks from, pinned by sha256: prompt files and agents' task files.

:func:`read_pinned` reads a file at any fsspec URL and refuses it when its bytes changed since
planning; :func:`seeded_sample` picks the first ``n`` rows of a seeded permutation, so task
``i`` does not depend on ``n`` and asking for more tasks than rows is an error (no cycling).
"""

from __future__ import annotations

import copy
import hashlib
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tasks.environments.seeding import check_task_request
from tasks.errors import PromptFileError


def recorded_path(path: str) -> str:
    """A portable URI: a local path becomes an absolute ``file://`` URI (the batch config reproduces it from
    any directory); URLs stay as given."""
    return path if "://" in path else "file://" + os.path.abspath(path)


@dataclass(frozen=True)
class PinnedFile:
    """A file's recorded URI, its bytes and their sha256 (hex)."""

    uri: str
    data: bytes
    sha256: str


def read_pinned(
    path: str, sha256: str | None, *, what: str, error: type[PromptFileError] = PromptFileError
) -> PinnedFile:
    """The file at ``path`` (``what`` names it in errors); ``error`` when unreadable or its sha256 is not ``sha256``."""
    uri = recorded_path(path)
    import fsspec  # the registry (and so DAG parsing) imports this module: open files only when used

    try:
        with fsspec.open(uri, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise error(f"{what} {uri} does not exist") from None
    except OSError as exc:  # a directory, no permission, an unreachable bucket
        raise error(f"{what} {uri} cannot be read: {exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and sha256 != digest:
        raise error(f"{what} {uri} changed: sha256 is {digest}, expected {sha256}")
    return PinnedFile(uri, data, digest)


def seeded_sample(
    rows: Sequence[dict[str, Any]],
    num_tasks: int,
    seed: int,
    *,
    env: str,
    what: str,
    error: type[PromptFileError] = PromptFileError,
) -> list[dict[str, Any]]:
    """Copies of the first ``num_tasks`` rows of the permutation of ``rows`` seeded by ``(env, seed)``."""
    check_task_request(num_tasks, seed, env=env)
    if num_tasks > len(rows):
        raise error(f"{what} has {len(rows)} rows, {num_tasks} tasks asked")
    order = list(range(len(rows)))
    random.Random(f"{env}:{seed}").shuffle(order)
    return [copy.deepcopy(rows[index]) for index in order[:num_tasks]]
