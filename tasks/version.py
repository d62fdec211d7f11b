"""The code version recorded in batch configs and attempt claims."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def code_version() -> str:
    """``rollout-ledger <version>`` of the installed package (``(not installed)`` from a bare checkout)."""
    try:
        return f"rollout-ledger {version('rollout-ledger')}"
    except PackageNotFoundError:
        return "rollout-ledger (not installed)"
