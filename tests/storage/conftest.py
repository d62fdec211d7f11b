"""Fixtures of the storage tests: a batch directory on every backend, or on memory:// only."""

from __future__ import annotations

import uuid

import pytest

from tasks import layout
from tasks.storage.objects import ObjectStore

from ._writer_process import BATCH


@pytest.fixture
def batch(store: ObjectStore) -> ObjectStore:
    """The batch directory on each backend: for behaviour that depends on the object store."""
    return store.child(layout.batch_dir(BATCH))


@pytest.fixture
def mem_batch() -> ObjectStore:
    """The batch directory on memory:// only: for logic that does not depend on the backend."""
    return ObjectStore(f"memory://ledger-{uuid.uuid4().hex[:12]}").child(layout.batch_dir(BATCH))
