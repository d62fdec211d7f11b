"""Trigger policy files for tests: a deployment's lists (tasks/trigger_policy.py) naming the tests' own storage."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tasks.orchestration.engine_servers import SERVERS_CONN_ID


def write_trigger_policy(path: Path, *, storage_urls: Sequence[str], storage_connections: Sequence[str] = ()) -> Path:
    """A policy file at ``path`` listing ``storage_urls`` and ``storage_connections``, and the tests' servers
    connection."""
    policy = {
        "storage": {"urls": list(storage_urls), "connections": list(storage_connections)},
        "servers": {"connections": [SERVERS_CONN_ID]},
    }
    path.write_text(json.dumps(policy))  # YAML is a superset of JSON
    return path
