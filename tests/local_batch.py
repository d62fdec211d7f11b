"""A batch generated under a local root for tests: its config, its directory, and private copies to damage."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.storage.objects import ObjectStore


@dataclass(frozen=True)
class LocalBatch:
    """A batch under a local root: its config, its directory and its :class:`~tasks.batch.Batch` handle."""

    root: Path
    config: BatchConfig

    @property
    def batch_id(self) -> str:
        return self.config.batch_id

    @property
    def dir(self) -> Path:
        return self.root / "batches" / self.batch_id

    @property
    def handle(self) -> Batch:
        return Batch.open(str(self.root), self.batch_id)

    @property
    def store(self) -> ObjectStore:
        return self.handle.store


def copy_batch(batch: LocalBatch, target: Path) -> LocalBatch:
    """A private copy of ``batch`` under ``target`` that a test may corrupt or validate."""
    shutil.copytree(batch.root, target / "root")
    return LocalBatch(root=target / "root", config=batch.config)
