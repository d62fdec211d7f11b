"""The weight records a ``rollout-ledger serve`` server keeps: which weights served each weight version.

The shape of the server's records routes, shared by the server (:mod:`tasks.engines.vllm_server.serving.records`)
and its clients (the rest of :mod:`tasks.engines.vllm_server`). A *load* is one set of weights the server
loaded: its start-up folder, a refit's folder, a load nobody announced, or a load that failed. The
server hashes the folder a load loaded itself, from its own file system: the start-up folder when
the app starts, a refit's folder once the load has answered. A refit also announces its weights
(:class:`Announcement`: the folder and the sha256 ``rollout-ledger refit`` computed where it ran,
before the load), and the refit's load keeps both hashes. For each weight version the server lists
every load that was in place while that version was current and generation was not paused: the
loads that may have sampled that version's tokens.

Invariant: a load is verified (:attr:`Load.verified_sha256`) only when the server hashed the folder
it loaded and, for a refit, that folder and its sha256 are the announced ones (the refit's hash
before the load and the server's after it agree); a version's weights are *verified*
(:meth:`WeightRecords.sha256_of` returns their sha256) only when every load of that version is
verified, all to the same sha256 (the same weights loaded again, or renamed); anything else is
declared, not verified (``None``). A refit load in the shape of servers that did not hash their
refits (no ``announced``) reads as announced only: declared.
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
_LOAD_KEYS = frozenset({"loaded_by", "weights_sha256", "folder"})


class RecordsFormatError(ValueError):
    """A records answer or announcement that is not of the shape this module defines."""


@dataclass(frozen=True)
class Announcement:
    """The weights a refit says its next load brings (``POST`` :data:`ANNOUNCE_PATH`): the folder, as the server
    names it, and its sha256 where the refit could hash it (else ``None``)."""

    weights_sha256: str | None
    folder: str

    def __post_init__(self) -> None:
        _check_sha256("announcement", self.weights_sha256)
        if not isinstance(self.folder, str) or not self.folder:
            raise RecordsFormatError(f"announcement: folder {self.folder!r} is not a path")

    def to_json(self) -> dict[str, Any]:
        return {"weights_sha256": self.weights_sha256, "folder": self.folder}

    @classmethod
    def from_json(cls, value: Any) -> Announcement:
        if not isinstance(value, dict) or set(value) != {"weights_sha256", "folder"}:
            raise RecordsFormatError(f"an announcement holds weights_sha256 and folder, got {str(value)[:200]}")
        return cls(**value)


@dataclass(frozen=True)
class Load:
    """One set of weights the server loaded.

    ``folder`` is the folder the load loaded, where its request names one; ``weights_sha256`` the
    server's own sha256 of it, ``None`` where the server hashed nothing. A refit's load (and only
    it) keeps what the refit announced (``announced``); whether the load is verified is
    :attr:`verified_sha256`.
    """

    loaded_by: str
    weights_sha256: str | None = None
    folder: str | None = None
    announced: Announcement | None = None

    def __post_init__(self) -> None:
        if self.loaded_by not in LOAD_KINDS:
            raise RecordsFormatError(f"load: loaded_by {self.loaded_by!r} is none of {LOAD_KINDS}")
        _check_sha256("load", self.weights_sha256)
        if self.loaded_by in (UNANNOUNCED_LOAD, FAILED_LOAD) and self.weights_sha256 is not None:
            raise RecordsFormatError(f"load: an {self.loaded_by} has no weights_sha256")
        if self.folder is not None and not isinstance(self.folder, str):
            raise RecordsFormatError(f"load: folder {self.folder!r} is not a string")
        if (self.loaded_by == LOADED_BY_REFIT) != isinstance(self.announced, Announcement):
            raise RecordsFormatError(
                f"load: a {LOADED_BY_REFIT} load keeps its announcement and no other load has one, got a "
                f"{self.loaded_by} with announced {self.announced!r}"
            )

    @property
    def verified_sha256(self) -> str | None:
        """The sha256 of this load's weights when verified, else ``None`` (declared, not verified).

        The start-up folder: the server's own hash. A refit: the server's own hash only when the
        refit announced that folder with that sha256 (the folder held those weights when the refit
        hashed it, before the load, and when the server hashed it, after).
        """
        if self.loaded_by == LOADED_AT_START:
            return self.weights_sha256
        announced = self.announced
        if announced is not None and (announced.weights_sha256, announced.folder) == (self.weights_sha256, self.folder):
            return self.weights_sha256
        return None

    def to_json(self) -> dict[str, Any]:
        value = {"loaded_by": self.loaded_by, "weights_sha256": self.weights_sha256, "folder": self.folder}
        return value if self.announced is None else value | {"announced": self.announced.to_json()}

    @classmethod
    def from_json(cls, value: Any) -> Load:
        if not isinstance(value, dict) or not _LOAD_KEYS <= set(value) <= {*_LOAD_KEYS, "announced"}:
            raise RecordsFormatError(
                f"load: expected loaded_by, weights_sha256, folder (and announced), got {str(value)[:200]}"
            )
        if "announced" in value:
            return cls(**value | {"announced": Announcement.from_json(value["announced"])})
        if value["loaded_by"] == LOADED_BY_REFIT:  # a server that did not hash its refits: the sha256 is the refit's
            return cls(LOADED_BY_REFIT, None, value["folder"], Announcement(value["weights_sha256"], value["folder"]))
        return cls(**value)


@dataclass(frozen=True)
class WeightRecords:
    """A server's records: the loads of each weight version, and what it serves now."""

    versions: dict[int, tuple[Load, ...]]
    serving_version: int
    serving: Load
    paused: bool

    def sha256_of(self, version: int) -> str | None:
        """The sha256 of ``version``'s weights when verified (every load verified, to one sha256); else ``None``."""
        hashes = {load.verified_sha256 for load in self.versions.get(version, ())}
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


def _check_sha256(record: str, value: Any) -> None:
    if value is not None and not (isinstance(value, str) and _SHA256.fullmatch(value)):
        raise RecordsFormatError(f"{record}: weights_sha256 {value!r} is not a lowercase hex sha256")


def version_number(value: Any) -> int:
    """A weight version as this project counts them: vLLM's ``default`` is 0, else an int >= 0 (or its text)."""
    if value == UNSET_WEIGHT_VERSION:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and str(int(value)) == value:
        return int(value)
    raise RecordsFormatError(f"weight version {value!r} is not an int >= 0")
