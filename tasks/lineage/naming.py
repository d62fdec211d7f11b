"""OpenLineage names of what a batch reads and writes, by the OpenLineage naming spec.

A dataset is a ``(namespace, name)`` pair: a local file is ``("file", "/absolute/path")``, an S3
object or prefix ``("s3://bucket", "key")``, a GCS one ``("gs://bucket", "key")``, anything else
fsspec reaches ``("scheme://authority", "path")``. Names hold no attempt, run or try number, so a
retried task names the same datasets; a shard's ledger and staged segments are each one dataset
(the shard's folder), never one per object.

The model is its batch-config reference: a folder is a local file dataset; the bundled model is
``("rollout-ledger", "bundled:<name>")`` (it has no path every worker shares). A server that serves
it is ``("http://host:port", model name)``.
"""

from __future__ import annotations

import os
from typing import NamedTuple
from urllib.parse import SplitResult, urlsplit

from openlineage.client.naming.dataset import GCS, S3, LocalFileSystem

from tasks import layout
from tasks.batch import Batch
from tasks.models.reference import is_bundled

BUNDLED_NAMESPACE = "rollout-ledger"


class DatasetName(NamedTuple):
    """An OpenLineage dataset identity."""

    namespace: str
    name: str


def name_of_url(url: str) -> DatasetName:
    """The dataset a path or fsspec URL names (a relative local path is made absolute)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("", "file", "local") or len(scheme) == 1:  # len 1: a Windows drive letter
        path = url.removeprefix(f"{parts.scheme}://") if scheme in ("file", "local") else url
        naming = LocalFileSystem(os.path.abspath(path))
    elif scheme in ("s3", "s3a"):
        naming = S3(_host(parts), parts.path.lstrip("/") or "/")
    elif scheme in ("gs", "gcs"):
        naming = GCS(_host(parts), parts.path.lstrip("/") or "/")
    else:
        return DatasetName(f"{scheme}://{_host(parts)}", parts.path.lstrip("/") or "/")
    return DatasetName(naming.get_namespace(), naming.get_name())


def _host(parts: SplitResult) -> str:
    """The URL's host and port, never its userinfo (a connection id, or credentials that must not reach an event)."""
    return parts.netloc.rpartition("@")[2]


def batch_object(batch: Batch, relative: str) -> DatasetName:
    """A batch-relative object or folder (``ledger/shard-00000``, ``dataset``) as a dataset."""
    store = batch.store
    return name_of_url(store.full_path(relative) if store.is_local else batch.url_of(relative))


def shard_ledger(batch: Batch, shard: int) -> DatasetName:
    return batch_object(batch, layout.ledger_shard_dir(shard))


def shard_staging(batch: Batch, shard: int) -> DatasetName:
    return batch_object(batch, layout.staging_shard_dir(shard))


def server(url: str, model_name: str) -> DatasetName:
    """A model as an inference server at ``url`` serves it."""
    parts = urlsplit(url)
    return DatasetName(f"{parts.scheme.lower()}://{_host(parts)}", model_name)


def model(reference: str) -> DatasetName:
    """The model a batch config references (see the module docstring)."""
    if is_bundled(reference):
        return DatasetName(BUNDLED_NAMESPACE, reference)
    return name_of_url(reference)
