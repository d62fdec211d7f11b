"""The weight records a ``rollout-ledger serve`` server keeps: which weights served each weight version.

The shape of the server's records routes, shared by the server (:mod:`tasks.engines.vllm_server.serving.records`)
and its clients (the rest of :mod:`tasks.engines.vllm_server`). A *load* is one set of weights the server
loaded: its start-up folder (hashed by the server itself), a refit's folder (hashed by
``rollout-ledger refit`` and announced before the load), a load nobody announced, or a load that
failed. For each weight version the server lists every load that was in place while that version
was current and generation was not paused: the loads that may have sampled that version's tokens.

Invariant: a version's weights are *verified* (:meth:`WeightRecords.sha256_of` returns their
sha256) only when every load of that version was hashed and all hash the same (the same weights
loaded again, or renamed); anything else is declared, not verified (``None``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

RECORDS_PATH = "/rollout-ledger/weights"  # GET: the records
ANNOUNCE_PATH = "/rollout-ledger/weights/next"  # POST: the weights the next load brings
UNSET_WEIGHT_VERSION = "default"  # what vLLM reports before a version is set: the weights it started with

# How a load came about (``Load.loaded_by``).
LOADED_AT_START = "serve start-up"
LOADED_BY_REFIT = "refit"
UNANNOUNCED_LOAD = "unannounced load"  # weights loaded through vLLM's own endpoints: nobody hashed them
FAILED_LOAD = "failed load"  # a load that answered an error: whatever it left behind
LOAD_KINDS = (LOADED_AT_START, LOADED_BY_REFIT, UNANNOUNCED_LOAD, FAILED_LOAD)
_SHA256 = re.compile(r"[0-9a-f]{64}")


class RecordsFormatError(ValueError):
    """A records answer or announcement that is not of the shape this module defines."""


@dataclass(frozen=True)
class Load:
    """One set of weights the server loaded; ``weights_sha256`` is ``None`` where nobody hashed them."""

    loaded_by: str
    weights_sha256: str | None = None
    folder: str | None = None

    def __post_init__(self) -> None:
        if self.loaded_by not in LOAD_KINDS:
            raise RecordsFormatError(f"load: loaded_by {self.loaded_by!r} is none of {LOAD_KINDS}")
        if self.weights_sha256 is not None and not (
            isinstance(self.weights_sha256, str) and _SHA256.fullmatch(self.weights_sha256)
        ):
            raise RecordsFormatError(f"load: weights_sha256 {self.weights_sha256!r} is not a lowercase hex sha256")
        if self.loaded_by in (UNANNOUNCED_LOAD, FAILED_LOAD) and self.weights_sha256 is not None:
            raise RecordsFormatError(f"load: an {self.loaded_by} has no weights_sha256")
        if self.folder is not None and not isinstance(self.folder, str):
            raise RecordsFormatError(f"load: folder {self.folder!r} is not a string")

    def to_json(self) -> dict[str, Any]:
        return {"loaded_by": self.loaded_by, "weights_sha256": self.weights_sha256, "folder": self.folder}

    @classmethod
    def from_json(cls, value: Any) -> Load:
        if not isinstance(value, dict) or set(value) != {"loaded_by", "weights_sha256", "folder"}:
            raise RecordsFormatError(f"load: expected loaded_by, weights_sha256 and folder, got {str(value)[:200]}")
        return cls(**value)


@dataclass(frozen=True)
class WeightRecords:
    """A server's records: the loads of each weight version, and what it serves now."""

    versions: dict[int, tuple[Load, ...]]
    serving_version: int
    serving: Load
    paused: bool

    def sha256_of(self, version: int) -> str | None:
        """The sha256 of ``version``'s weights when they are verified (every load hashed, one sha256); else ``None``."""
        hashes = {load.weights_sha256 for load in self.versions.get(version, ())}
        return hashes.pop() if len(hashes) == 1 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "versions": {str(v): [load.to_json() for load in loads] for v, loads in sorted(self.versions.items())},
            "serving": {"version": self.serving_version, "paused": self.paused, "load": self.serving.to_json()},
        }

    @classmethod
    def from_json(cls, value: Any) -> WeightRecords:
        try:
            serving = value["serving"]
            versions = {
                version_number(key): tuple(Load.from_json(load) for load in loads)
                for key, loads in value["versions"].items()
            }
            if not isinstance(serving["paused"], bool):
                raise RecordsFormatError(f"serving.paused {serving['paused']!r} is not a bool")
            return cls(versions, version_number(serving["version"]), Load.from_json(serving["load"]), serving["paused"])
        except (KeyError, TypeError, AttributeError) as exc:
            raise RecordsFormatError(f"weight records lack {exc}: {str(value)[:200]}") from None


def version_number(value: Any) -> int:
    """A weight version as this project counts them: vLLM's ``default`` is 0, else an int >= 0 (or its text)."""
    if value == UNSET_WEIGHT_VERSION:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and str(int(value)) == value:
        return int(value)
    raise RecordsFormatError(f"weight version {value!r} is not an int >= 0")
