"""Where a DAG run's batches live: an Airflow ``ObjectStoragePath`` turned into a root URL + storage options.

Stage functions take a plain fsspec root URL and storage options (docs/architecture.md §12). In
Airflow the storage is named like any Object Storage path — ``file:///data/batches``,
``s3://bucket/prefix``, or ``s3://conn_id@bucket/prefix`` / a separate connection id — and the
connection's credentials become the options. They are resolved in each task from the run's
params and never cross XCom, logs or the batch itself.

The options are read from the filesystem Airflow builds for the path (the Amazon provider's
``get_fs``, over its ``S3Hook``: endpoint, ``config_kwargs``, proxies, anonymous access), not
rebuilt from the hook here, so they stay exactly what Airflow's own Object Storage uses.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from tasks.errors import ConfigError
from tasks.storage.options import STORAGE_OPTIONS_VARIABLE
from tasks.storage.root_urls import check_root_url

S3_PROTOCOLS = ("s3", "s3a")


@dataclass(frozen=True)
class StorageLocation:
    """A root URL every stage accepts, and the fsspec options that reach it (credentials: keep private)."""

    root_url: str
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)

    def environment(self) -> dict[str, str]:
        """The options as the variable a ``rollout-ledger`` process reads them from (``{}`` when there are none)."""
        return {STORAGE_OPTIONS_VARIABLE: json.dumps(self.storage_options)} if self.storage_options else {}


def check_storage_url(url: str) -> None:
    """Refuse a storage URL that carries a password (credentials belong in a connection), without echoing it."""
    if urlsplit(url).password is not None:
        raise ConfigError(
            f"storage_url {redacted(url)!r} carries credentials; put them in an Airflow connection and name it "
            "(storage_conn_id, or s3://conn_id@bucket/prefix)"
        )


def redacted(url: str) -> str:
    """``url`` with userinfo that carries a password replaced by ``***``: safe to log."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=f"***@{parts.hostname or ''}").geturl()


def storage_location(url: str, conn_id: str | None = None) -> StorageLocation:
    """Resolve ``url`` (and ``conn_id``, which wins over one in the URL) through Airflow's Object Storage.

    The root URL is ``url`` without its connection id; the options come from the filesystem
    Airflow builds for the connection. A URL carrying a password is refused, and so is one the CLI's
    ``--root`` would refuse (:func:`tasks.storage.root_urls.check_root_url`: ``s3:/bucket``, ``file://host/path``,
    a scheme this install cannot write to), naming what was probably meant and the supported schemes.
    """
    check_storage_url(url)
    url = check_root_url(url, connection_ids=True)
    parts = urlsplit(url)
    protocol = parts.scheme or "file"
    if protocol in ("file", "local"):
        return StorageLocation(f"file://{os.path.abspath(parts.path)}")
    if protocol not in S3_PROTOCOLS:
        raise ConfigError(f"storage_url {url!r}: scheme {protocol!r} is not supported; use file:// or s3://")
    if not parts.hostname:
        raise ConfigError(f"storage_url {url!r} names no bucket; use s3://bucket/prefix")
    root = f"{protocol}://{parts.hostname}{parts.path}".rstrip("/")
    from airflow.sdk import ObjectStoragePath

    try:
        path = ObjectStoragePath(url, conn_id=conn_id or None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"storage_url {url!r}: {exc}") from None
    return StorageLocation(root, _s3_options(path.fs))


def _s3_options(fs: Any) -> dict[str, Any]:
    """Plain s3fs options from the filesystem Airflow built for the connection (its botocore session).

    The secret key and session token are masked in Airflow's logs, as ``S3Hook.get_credentials`` masks them
    (a role's temporary credentials are no connection field, so nothing else masks them).
    """
    from airflow.sdk.log import mask_secret

    built = fs.storage_options
    options: dict[str, Any] = {}
    session = built.get("session")
    if session is not None:
        credentials = asyncio.run(_frozen_credentials(session))
        if credentials is not None:
            options.update(key=credentials.access_key, secret=credentials.secret_key)
            mask_secret(credentials.secret_key)
            if credentials.token:
                options["token"] = credentials.token
                mask_secret(credentials.token)
        region = session.get_config_variable("region")
        if region:
            options["client_kwargs"] = {"region_name": region}
    if built.get("endpoint_url"):
        options["endpoint_url"] = built["endpoint_url"]
    if built.get("anon"):
        options["anon"] = True
    if built.get("config_kwargs"):
        options["config_kwargs"] = dict(built["config_kwargs"])
    return options


async def _frozen_credentials(session: Any) -> Any:
    credentials = await session.get_credentials()
    return None if credentials is None else await credentials.get_frozen_credentials()
