"""Which weights sampled each weight version, read from the calls: per batch (``weights_by_version`` of the
metrics) and per dataset row (its ``weights_by_version`` column).

A call of an engine that knows them names, in its extras, the sha256 of the weights of each
version that sampled its tokens, or null where they were not verified
(:func:`tasks.models.provenance.weights_extras`; when the capture adds notes of its own it keeps
the engine's extras under ``"engine"``, :func:`tasks.capture.recording.engine_extras`). A call that
names nothing (an engine that loads the planned weights itself, or a batch written before calls
named them) counts at its admission version: the plan's check there when that is the planned
version, nothing at any other. :meth:`PlannedWeights.accounts` reads one call; :func:`judged`
judges a version from the accounts of its calls. The batch judges over the calls of every
receipt's chain, root to terminal, as staged (:class:`BatchWeights`); a row over the calls whose
tokens it holds (:func:`row_weights`).

Invariant (fail closed): a version is verified (a sha256) only when every call naming it names the
same sha256; anything else (not hashed, not named, malformed extras, several sha256s) is declared,
not verified.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.capture.recording import engine_extras
from tasks.checks import is_hex_digest
from tasks.config import BatchConfig
from tasks.finalize.ragged import offsets, ranges
from tasks.models.provenance import WEIGHTS_DECLARED, WEIGHTS_VERIFIED, read_weights_extras

# What a call says of one version's weights, besides a sha256 (an account of PlannedWeights.accounts).
NOT_HASHED = "not hashed"  # the engine said so: nobody hashed that version's weights
NOT_NAMED = "not named by the engine"  # the call names no weights for its version
MALFORMED = "malformed weights extras"


@dataclass(frozen=True)
class PlannedWeights:
    """The plan's weights: the planned ``version``, and its weights' ``sha256`` where the plan verified them
    (``None`` otherwise): what a call that names nothing had at the planned version."""

    version: int = 0
    sha256: str | None = None

    @classmethod
    def of_plan(cls, config: BatchConfig) -> PlannedWeights:
        """The planned version, and its weights' sha256 where the plan verified them."""
        verified = config.model.weights == WEIGHTS_VERIFIED and config.model.weights_sha256
        return cls(config.weight_version, config.model.weights_sha256 if verified else None)

    def accounts(self, version: int, extras_json: str | None) -> dict[int, str]:
        """What one call admitted at ``version`` says of each version that sampled its tokens.

        Version -> a sha256, :data:`NOT_HASHED`, :data:`NOT_NAMED` or :data:`MALFORMED`; always
        something of ``version`` itself (the version its row's weight span names). A call that names
        nothing takes the plan's sha256 at the planned version when the plan verified it; a call
        that names other versions but not its own says :data:`NOT_NAMED` of it.
        """
        try:
            extras = json.loads(extras_json) if extras_json is not None else None
        except ValueError:
            return {version: MALFORMED}
        try:
            by_version = read_weights_extras(engine_extras(extras))
        except ValueError:
            return {version: MALFORMED}
        if by_version is None:
            if version == self.version and self.sha256 is not None:
                return {version: self.sha256}
            return {version: NOT_NAMED}
        return {version: NOT_NAMED} | {v: NOT_HASHED if sha is None else sha for v, sha in by_version.items()}


def judged(accounts: Iterable[str]) -> str | None:
    """The sha256 of a version whose calls gave ``accounts``: the one sha256 they all name, else None
    (declared, not verified)."""
    distinct = set(accounts)
    if len(distinct) != 1:
        return None
    (only,) = distinct
    return only if is_hex_digest(only) else None


@dataclass
class BatchWeights:
    """Accumulates, per weight version, what the batch's calls say (:meth:`PlannedWeights.accounts`);
    :meth:`result` judges each version."""

    plan: PlannedWeights = field(default_factory=PlannedWeights)
    named: dict[int, Counter[str]] = field(default_factory=dict)  # version -> account -> calls

    @classmethod
    def of_plan(cls, config: BatchConfig) -> BatchWeights:
        """Before any call: the planned version, and its weights' sha256 where the plan verified them."""
        return cls(PlannedWeights.of_plan(config))

    def add_staged(self, staged: pa.Table) -> None:
        """Count the calls of ``staged`` (staged rows: their ``weight_version`` and ``extras_json``)."""
        counted = staged.group_by(["weight_version", "extras_json"]).aggregate([("weight_version", "count")])
        for version, text, count in zip(
            counted.column("weight_version").to_pylist(),
            counted.column("extras_json").to_pylist(),
            counted.column("weight_version_count").to_pylist(),
            strict=True,
        ):
            for named_version, named in self.plan.accounts(version, text).items():
                self.named.setdefault(named_version, Counter())[named] += count

    def result(self) -> dict[str, dict[str, Any]]:
        """Per version (as text): ``calls``, ``weights`` (verified or declared), ``weights_sha256`` and, when
        declared, ``why``."""
        judgements = {}
        for version, named in sorted(self.named.items()):
            entry: dict[str, Any] = {"calls": sum(named.values())}
            sha = judged(named)
            values = sorted(named)
            if sha is not None:
                entry |= {"weights": WEIGHTS_VERIFIED, "weights_sha256": sha}
            elif len(values) == 1:
                entry |= {"weights": WEIGHTS_DECLARED, "weights_sha256": None, "why": values[0]}
            else:
                shown = ", ".join(f"{v[:12]}…" if len(v) == 64 else v for v in values)
                entry |= {"weights": WEIGHTS_DECLARED, "weights_sha256": None, "why": f"several weights: {shown}"}
            judgements[str(version)] = entry
        return judgements


@dataclass(frozen=True)
class RowWeights:
    """Per row, the weights of each version that sampled its tokens, as flat columns.

    Row ``i`` holds entries ``starts[i]:starts[i + 1]`` of ``versions`` (uint64, ascending within a
    row, no repeats) and ``sha256`` (string, null: declared, not verified).
    """

    starts: np.ndarray
    versions: pa.Array
    sha256: pa.Array


def row_weights(
    plan: PlannedWeights, call_rows: np.ndarray, versions: np.ndarray, extras_json: pa.Array, rows: int
) -> RowWeights:
    """The weights of each of ``rows`` rows from its calls: call ``k`` (of row ``call_rows[k]``) was admitted at
    ``versions[k]`` with extras ``extras_json[k]``.

    A row's version is a sha256 exactly when :func:`judged` says so of the accounts the row's calls
    give of that version (:meth:`PlannedWeights.accounts`). Each distinct (extras, admission version)
    is read once and each distinct judgement made once; the rest is numpy.
    """
    texts = pc.dictionary_encode(pa.array(extras_json, pa.string()))
    text_of_call = pc.fill_null(texts.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    dictionary = texts.dictionary.to_pylist()
    admitted, version_of_call = np.unique(np.asarray(versions, np.uint64), return_inverse=True)
    pairs, pair_of_call = np.unique((text_of_call + 1) * admitted.size + version_of_call, return_inverse=True)
    codes: dict[str, int] = {}  # each account met -> its code
    said_counts: list[int] = []
    said_versions: list[int] = []
    said_codes: list[int] = []
    pair_texts, pair_versions = np.divmod(pairs, max(admitted.size, 1))
    for text, version in zip((pair_texts - 1).tolist(), admitted[pair_versions].tolist(), strict=True):
        said = plan.accounts(version, dictionary[text] if text >= 0 else None)
        said_counts.append(len(said))
        for named_version, account in sorted(said.items()):
            said_versions.append(named_version)
            said_codes.append(codes.setdefault(account, len(codes)))
    # one entry per (call, version it names): its row, the version, the call's account of it
    pair_of_call = np.asarray(pair_of_call, np.int64).reshape(-1)
    lengths = np.asarray(said_counts, np.int64)
    entries, _ = ranges(offsets(lengths)[:-1][pair_of_call], lengths[pair_of_call])
    row = np.repeat(np.asarray(call_rows, np.int64), lengths[pair_of_call])
    version = np.asarray(said_versions, np.uint64)[entries]
    code = np.asarray(said_codes, np.int64)[entries]
    order = np.lexsort((code, version, row))
    row, version, code = row[order], version[order], code[order]
    head = np.ones(row.size, bool)
    head[1:] = (row[1:] != row[:-1]) | (version[1:] != version[:-1])
    heads = np.flatnonzero(head)
    lowest, highest = code[heads], code[np.append(heads[1:], row.size)[: heads.size] - 1]
    # a (row, version)'s accounts are all one exactly when its lowest and highest codes are: judge those two
    names = list(codes)
    verdicts, verdict_of = np.unique(lowest * len(names) + highest, return_inverse=True)
    shas = [judged({names[key // len(names)], names[key % len(names)]}) for key in verdicts.tolist()]
    return RowWeights(
        starts=offsets(np.bincount(row[heads], minlength=rows)),
        versions=pa.array(version[heads], pa.uint64()),
        sha256=pa.array(shas, pa.string()).take(pa.array(np.asarray(verdict_of, np.int64).reshape(-1))),
    )
