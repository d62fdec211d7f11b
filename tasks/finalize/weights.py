"""Which weights sampled each weight version of a batch's rows, read from their calls (``weights_by_version``).

The calls read are those of every receipt's chain, root to terminal, as staged: the calls whose
tokens the rows hold, their segments checked against the shard markers. A call of an engine that
knows them names, in its extras, the sha256 of the weights of each version that sampled its
tokens, or null where they were not verified (:func:`tasks.models.provenance.weights_extras`;
when the gateway adds notes of its own it keeps the engine's extras under ``"engine"``,
:mod:`tasks.capture.calls`). A call that names nothing (an engine that loads the planned weights
itself, or a batch written before calls named them) counts at its admission version: the plan's
check there when that is the planned version, nothing at any other.

Invariant: a version is verified only when every call naming it names the same sha256.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from tasks.config import BatchConfig
from tasks.models.provenance import WEIGHTS_DECLARED, WEIGHTS_VERIFIED, read_weights_extras

# What a call says of one version's weights, besides a sha256 (a value of BatchWeights.named).
NOT_HASHED = "not hashed"  # the engine said so: nobody hashed that version's weights
NOT_NAMED = "not named by the engine"  # the call names no weights for its version
MALFORMED = "malformed weights extras"


@dataclass
class BatchWeights:
    """Accumulates, per weight version, what the batch's calls name; :meth:`result` judges each version.

    ``planned_version`` and ``planned_sha256`` are the plan's: the weights calls that name nothing
    had at the planned version (``None`` where the plan did not verify them).
    """

    planned_version: int = 0
    planned_sha256: str | None = None
    named: dict[int, Counter[str]] = field(default_factory=dict)  # version -> sha256 or a word above -> calls

    @classmethod
    def of_plan(cls, config: BatchConfig) -> BatchWeights:
        """Before any call: the planned version, and its weights' sha256 where the plan verified them."""
        verified = config.model.weights == WEIGHTS_VERIFIED and config.model.weights_sha256
        return cls(config.weight_version, config.model.weights_sha256 if verified else None)

    def add_staged(self, staged: pa.Table) -> None:
        """Count the calls of ``staged`` (staged rows: their ``weight_version`` and ``extras_json``)."""
        counted = staged.group_by(["weight_version", "extras_json"]).aggregate([("weight_version", "count")])
        for version, text, count in zip(
            counted.column("weight_version").to_pylist(),
            counted.column("extras_json").to_pylist(),
            counted.column("weight_version_count").to_pylist(),
            strict=True,
        ):
            for named_version, named in _named(version, text).items():
                self.named.setdefault(named_version, Counter())[named] += count

    def result(self) -> dict[str, dict[str, Any]]:
        """Per version (as text): ``calls``, ``weights`` (verified or declared), ``weights_sha256`` and, when
        declared, ``why``."""
        judged = {}
        for version, named in sorted(self.named.items()):
            values = sorted({self._resolved(version, value) for value in named})
            entry: dict[str, Any] = {"calls": sum(named.values())}
            if len(values) == 1 and values[0] not in (NOT_HASHED, NOT_NAMED, MALFORMED):
                entry |= {"weights": WEIGHTS_VERIFIED, "weights_sha256": values[0]}
            elif len(values) == 1:
                entry |= {"weights": WEIGHTS_DECLARED, "weights_sha256": None, "why": values[0]}
            else:
                shown = ", ".join(f"{v[:12]}…" if len(v) == 64 else v for v in values)
                entry |= {"weights": WEIGHTS_DECLARED, "weights_sha256": None, "why": f"several weights: {shown}"}
            judged[str(version)] = entry
        return judged

    def _resolved(self, version: int, value: str) -> str:
        """A call's account of ``version``, with "not named" at the planned version taken from the plan."""
        if value == NOT_NAMED and version == self.planned_version and self.planned_sha256 is not None:
            return self.planned_sha256
        return value


def _named(version: int, extras_json: str) -> dict[int, str]:
    """What one staged call names: version -> sha256, :data:`NOT_HASHED`, :data:`NOT_NAMED` or :data:`MALFORMED`."""
    extras = json.loads(extras_json)
    if isinstance(extras, dict) and "gateway" in extras:  # the gateway's envelope (tasks.capture.calls)
        extras = extras.get("engine")
    try:
        by_version = read_weights_extras(extras)
    except ValueError:
        return {version: MALFORMED}
    if by_version is None:
        return {version: NOT_NAMED}
    return {v: NOT_HASHED if sha is None else sha for v, sha in by_version.items()}
