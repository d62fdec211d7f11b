"""Walking a checkpoint's lineage back to checkpoint 0, every hop checked by hash (docs/lineage.md, "Checkpoints").

The chain of the training loop, read backwards from a checkpoint folder (``checkpoint.json``,
:mod:`tasks.trainer.checkpoint`)::

    checkpoint N ──consumed──> dataset (batch B's dataset/_COMMITTED.json) ──> batch B (plan/batch.json)
        │                                                                         │ sampled by
        └──parent──> checkpoint N-1 <─────────────────────────────────────────────┘
                         └── ... ──> checkpoint 0 (no parent)

Each hop is a :class:`Hop` holding the checks that tie it to the hop that named it and to its own bytes:

* a checkpoint: its manifest reads, its weights hash (:func:`tasks.models.provenance.hashed_weights`) to the
  manifest's ``weights_sha256``, and that sha256 is the one the naming hop recorded (a child's ``parent``, or the
  weights a batch was sampled with); a checkpoint without a parent is step 0;
* a consumed dataset: the sha256 of its ``_COMMITTED.json`` bytes is the one the checkpoint recorded, the marker
  is of that batch, and every part it names has the size and sha256 it records;
* a batch: its config (``plan/batch.json``) is the one the dataset marker recorded, the weights that sampled it
  are known by hash (its model's sha256 verified by the plan, or, for a server's weights accepted by name, the
  sha256 the server hashed named by every row), and every row's ``weights_by_version`` names a sha256 (none
  null); each distinct sha256 (the config's and the rows') is a "sampled by" hop to the checkpoint folder
  whose manifest names those weights: the model reference's folder when it is a checkpoint, else one found
  under the checkpoint roots searched.

A hop that does not verify is kept in the tree with its failed checks (never dropped), and the walk goes on
where it still can; :attr:`Hop.all_ok` is false when any hop failed. A checkpoint or dataset met twice is walked
once: later hops to it are shown with ``seen`` and their link checked.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from tasks import layout
from tasks.config import BatchConfig
from tasks.models.provenance import WEIGHTS_VERIFIED, hashed_weights
from tasks.models.reference import is_bundled
from tasks.storage.dataset_manifest import DatasetMarker, read_dataset_part
from tasks.storage.objects import ObjectStore
from tasks.storage.options import StorageOptions
from tasks.trainer.checkpoint import (
    MANIFEST_NAME,
    CheckpointManifest,
    ConsumedDataset,
    checkpoint_folders,
    read_checkpoint,
)

CHECKPOINT, DATASET, BATCH = "checkpoint", "dataset", "batch"


@dataclass(frozen=True)
class Check:
    """One verification of a hop: its name, whether it held, and what was compared (or what went wrong)."""

    name: str
    ok: bool
    detail: str


@dataclass
class Hop:
    """A node of the lineage tree: a checkpoint, a consumed dataset or a batch, with its checks and its children.

    ``relation`` says how the hop that names it reached it (``start``, ``consumed``, ``batch``, ``sampled by``,
    ``parent``); ``seen`` marks a hop walked earlier in the tree (its children are shown there).
    """

    kind: str
    name: str
    relation: str
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    children: list[Hop] = field(default_factory=list)
    seen: bool = False
    first: Hop | None = field(default=None, repr=False)  # for a seen hop: where it was walked

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def all_ok(self) -> bool:
        """Whether this hop and every hop below it verified."""
        return self.ok and all(child.all_ok for child in self.children)

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    def failed(self) -> list[Hop]:
        """Every hop of the tree (this one included) with a failed check, in tree order."""
        return ([self] if not self.ok else []) + [hop for child in self.children for hop in child.failed()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "relation": self.relation,
            "ok": self.ok,
            "seen": self.seen,
            **({"verified_above": self.first.ok} if self.first is not None else {}),
            "facts": self.facts,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
            "children": [child.to_dict() for child in self.children],
        }


def walk_checkpoint(
    folder: str | Path,
    *,
    checkpoint_roots: Sequence[str | Path] = (),
    storage_options: Callable[[str], StorageOptions] | None = None,
) -> Hop:
    """The lineage tree of the checkpoint in ``folder`` (see the module docstring).

    A batch's sampling checkpoint is looked for in the batch's model folder, then among the ``step-NNNNNN``
    folders of ``checkpoint_roots`` and of the starting checkpoint's own root. ``storage_options`` gives the fsspec
    options of a batch's URL (none: no options).
    """
    start = Path(folder)
    roots = [Path(root) for root in checkpoint_roots] + [start.parent]
    walker = _Walker(roots, storage_options or (lambda url: {}))
    return walker.checkpoint(start, relation="start", expected_sha256=None)


class _Walker:
    def __init__(self, roots: list[Path], storage_options: Callable[[str], StorageOptions]) -> None:
        self.roots = roots
        self.storage_options = storage_options
        self.walked: dict[str, Hop] = {}  # checkpoint folders and datasets already in the tree
        self._manifests: dict[str, CheckpointManifest | None] = {}

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(self, folder: Path, *, relation: str, expected_sha256: str | None) -> Hop:
        hop = Hop(CHECKPOINT, str(folder), relation)
        manifest = self._manifest(hop, folder)
        if manifest is None:
            return hop
        hop.facts = {
            "step": manifest.step,
            "weight_version": manifest.weight_version,
            "weights_sha256": manifest.weights_sha256,
        }
        if expected_sha256 is not None:
            hop.check(
                "link",
                manifest.weights_sha256 == expected_sha256,
                f"manifest names weights {_short(manifest.weights_sha256)}, the {relation} hop recorded "
                f"{_short(expected_sha256)}",
            )
        key = f"{CHECKPOINT}:{folder.resolve()}"
        if key in self.walked:
            hop.seen, hop.first = True, self.walked[key]
            return hop
        self.walked[key] = hop
        found = hashed_weights(folder)
        hop.check(
            "weights",
            found == manifest.weights_sha256,
            f"weight files hash to {_short(found) if found else 'nothing (no weight files)'}, the manifest names "
            f"{_short(manifest.weights_sha256)}",
        )
        for consumed in manifest.consumed:
            hop.children.append(self.dataset(consumed))
        if manifest.parent is None:
            hop.check("root", manifest.step == 0, f"no parent: checkpoint 0 (step {manifest.step})")
        else:
            parent = Path(manifest.parent.folder)
            if not parent.is_absolute():
                parent = folder.parent / parent
            hop.children.append(
                self.checkpoint(parent, relation="parent", expected_sha256=manifest.parent.weights_sha256)
            )
        return hop

    def _manifest(self, hop: Hop, folder: Path) -> CheckpointManifest | None:
        try:
            manifest = read_checkpoint(folder, verify_weights=False).manifest
        except Exception as exc:  # any unreadable manifest is a failed hop, named, not an exception
            hop.check("manifest", False, f"{folder / MANIFEST_NAME}: {exc}")
            return None
        hop.check("manifest", True, f"{MANIFEST_NAME} step {manifest.step}")
        return manifest

    def _manifest_quiet(self, folder: Path) -> CheckpointManifest | None:
        key = str(folder.resolve())
        if key not in self._manifests:
            try:
                self._manifests[key] = read_checkpoint(folder, verify_weights=False).manifest
            except Exception:
                self._manifests[key] = None
        return self._manifests[key]

    def sampler(self, sha256: str, config: BatchConfig) -> Hop:
        """The hop to the checkpoint whose manifest names the weights ``sha256`` that sampled the batch."""
        candidates: list[Path] = []
        if not is_bundled(config.model.reference) and Path(config.model.reference).is_dir():
            candidates.append(Path(config.model.reference))
        for root in self.roots:
            candidates.extend(checkpoint_folders(root))
        for folder in candidates:
            manifest = self._manifest_quiet(folder)
            if manifest is not None and manifest.weights_sha256 == sha256:
                return self.checkpoint(folder, relation="sampled by", expected_sha256=sha256)
        hop = Hop(CHECKPOINT, "unknown", "sampled by", facts={"weights_sha256": sha256})
        searched = ", ".join(str(root) for root in self.roots)
        hop.check(
            "found",
            False,
            f"no checkpoint names weights {_short(sha256)} (the batch's model {config.model.reference}; "
            f"checkpoints searched under {searched}): sampled by an unknown checkpoint",
        )
        return hop

    # ---------------------------------------------------------------- datasets and batches
    def dataset(self, consumed: ConsumedDataset) -> Hop:
        hop = Hop(DATASET, f"{consumed.batch_url.rstrip('/')}/{layout.DATASET_DIR}", "consumed")
        hop.facts = {"batch_id": consumed.batch_id, "dataset_sha256": consumed.dataset_sha256}
        key = f"{DATASET}:{consumed.batch_url}:{consumed.dataset_sha256}"
        if key in self.walked:
            hop.seen, hop.first = True, self.walked[key]
            return hop
        self.walked[key] = hop
        try:
            store = ObjectStore(consumed.batch_url, **dict(self.storage_options(consumed.batch_url)))
            data = store.read_bytes(layout.DATASET_MARKER)
        except Exception as exc:
            hop.check("marker", False, f"{layout.DATASET_MARKER} unreadable: {exc}")
            return hop
        found = hashlib.sha256(data).hexdigest()
        if not hop.check(
            "marker",
            found == consumed.dataset_sha256,
            f"{layout.DATASET_MARKER} sha256 {_short(found)}, "
            f"the checkpoint recorded {_short(consumed.dataset_sha256)}",
        ):
            return hop  # another marker than the one trained on: its parts and batch say nothing about the step
        try:
            marker = DatasetMarker.from_json(data, source=f"{consumed.batch_url}/{layout.DATASET_MARKER}")
        except Exception as exc:
            hop.check("marker", False, f"does not parse: {exc}")
            return hop
        hop.check(
            "batch",
            marker.batch_id == consumed.batch_id,
            f"marker of batch {marker.batch_id}, the checkpoint recorded {consumed.batch_id}",
        )
        hop.facts.update(rows=marker.rows, trainable_rows=marker.trainable_rows, parts=len(marker.parts))
        tables, bad = [], []
        for part in marker.parts:
            try:
                tables.append(read_dataset_part(store, part))
            except Exception as exc:
                bad.append(f"{part.path}: {exc}")
        hop.check(
            "parts",
            not bad,
            f"{len(marker.parts)} part(s), {marker.rows} rows: sizes and sha256 as the marker records"
            if not bad
            else "; ".join(bad),
        )
        hop.children.append(self.batch(store, consumed, marker, tables if not bad else None))
        return hop

    def batch(
        self, store: ObjectStore, consumed: ConsumedDataset, marker: DatasetMarker, tables: list[pa.Table] | None
    ) -> Hop:
        hop = Hop(BATCH, consumed.batch_id, "batch")
        try:
            config = BatchConfig.from_json(store.read_bytes(layout.plan_config()), source=store.url)
        except Exception as exc:
            hop.check("config", False, f"{layout.plan_config()} unreadable: {exc}")
            return hop
        model = config.model
        hop.facts = {
            "model": model.reference,
            "weights_sha256": model.weights_sha256,
            "weights": model.weights,
            "weight_version": config.weight_version,
        }
        planned = json.loads(config.to_json())
        hop.check(
            "config",
            (marker.config.get("batch_id"), marker.config.get("model")) == (planned["batch_id"], planned["model"]),
            f"{layout.plan_config()} names the batch and model the dataset marker recorded",
        )
        verified = bool(model.weights_sha256) and model.weights == WEIGHTS_VERIFIED
        shas = [model.weights_sha256] if model.weights_sha256 else []
        rows_named = False
        if tables is None:
            hop.check("rows", False, "the dataset's parts did not verify: the rows' weights are not read")
        else:
            named = _rows_weights(tables)
            nulls = named.pop(None, 0)
            total = sum(named.values()) + nulls
            listing = ", ".join(f"{count} {_short(sha)}" for sha, count in sorted(named.items()))
            rows_named = hop.check(
                "rows",
                nulls == 0,
                f"row weight versions name {listing or 'nothing'}"
                + (f"; {nulls} of {total} name none (declared, not verified)" if nulls else ""),
            ) and bool(named)
            shas += [sha for sha in sorted(named) if sha not in shas]
        # the plan hashed the weights it generated with, or (a server's weights, accepted by name) every row names
        # the sha256 the server itself hashed at load: either way the sampling weights are known by hash
        how = "verified by the plan" if verified else "named by every row" if rows_named else model.weights
        hop.check(
            "model",
            verified or rows_named,
            f"weights {_short(model.weights_sha256) or 'not recorded'} ({how})",
        )
        for sha in shas:
            hop.children.append(self.sampler(sha, config))
        return hop


def _rows_weights(tables: Iterable[pa.Table]) -> Counter:
    """How many (row, weight version) pairs name each sha256 (None: declared, not verified)."""
    counts: Counter = Counter()
    for table in tables:
        for weights in table.column("weights_by_version").to_pylist():
            for item in weights:
                counts[item["weights_sha256"]] += 1
    return counts


def _short(sha: str | None) -> str:
    return sha[:12] if sha else ""


# ---------------------------------------------------------------- rendering
_MARK = {True: "ok", False: "FAILED"}


def render_tree(hop: Hop) -> str:
    """The tree as text: one line per hop (its verdict, what it is, its key facts), failed checks under it."""
    lines: list[str] = []
    _render(hop, lines, prefix="", last=True, root=True)
    failed = hop.failed()
    verdict = "every hop verified" if not failed else f"{len(failed)} hop(s) did not verify"
    lines.append(verdict)
    return "\n".join(lines) + "\n"


def _render(hop: Hop, lines: list[str], *, prefix: str, last: bool, root: bool = False) -> None:
    branch = "" if root else ("└── " if last else "├── ")
    lines.append(f"{prefix}{branch}[{_MARK[hop.ok]}] {_label(hop)}")
    inner = prefix + ("" if root else ("    " if last else "│   "))
    bar = "    " if not hop.children else "│   "
    for check in hop.checks:
        if not check.ok:
            lines.append(f"{inner}{bar}! {check.name}: {check.detail}")
    for index, child in enumerate(hop.children):
        _render(child, lines, prefix=inner, last=index == len(hop.children) - 1)


def _seen(hop: Hop) -> str:
    if not hop.seen:
        return ""
    return "  (walked above)" if hop.first is None or hop.first.ok else "  (walked above, did not verify there)"


def _label(hop: Hop) -> str:
    relation = "" if hop.relation in ("start", "batch") else f"{hop.relation}: "
    facts = hop.facts
    if hop.kind == CHECKPOINT:
        if hop.name == "unknown":
            return f"{relation}checkpoint ? (weights {_short(facts.get('weights_sha256'))})"
        described = f"{relation}checkpoint {hop.name}"
        if "step" in facts:
            step, version, sha = facts["step"], facts["weight_version"], _short(facts["weights_sha256"])
            described += f"  step {step}, weight version {version}, weights {sha}"
        return described + _seen(hop)
    if hop.kind == DATASET:
        described = f"{relation}dataset {hop.name}  _COMMITTED.json {_short(facts.get('dataset_sha256'))}"
        if "rows" in facts:
            described += f", {facts['rows']} rows in {facts['parts']} part(s)"
        return described + _seen(hop)
    described = f"{relation}batch {hop.name}"
    if "model" in facts:
        described += f"  model {facts['model']}, weights {_short(facts['weights_sha256'])} ({facts['weights']})"
    return described
