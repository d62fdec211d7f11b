"""Policy checkpoints: a Hugging Face folder plus ``checkpoint.json``, written atomically, read only when verified.

A checkpoint is the folder ``{root}/step-NNNNNN`` holding what ``from_pretrained`` loads (config, tokenizer
files, ``model.safetensors``) and its manifest ``checkpoint.json``::

    {"format": "rollout-ledger-checkpoint", "version": 1, "step": N, "weight_version": V,
     "weights_sha256": <tasks.models.provenance.hashed_weights of the folder>,
     "parent": {"folder": <the parent's folder>, "weights_sha256": <its sha256>} | null (checkpoint 0),
     "consumed": [{"batch_url": ..., "batch_id": ..., "dataset_sha256": <sha256 of dataset/_COMMITTED.json>}],
     "created_at": <ISO-8601, UTC>}

Invariants (docs/training.md):

* a checkpoint is complete or absent: it is built in a hidden temporary sibling and renamed to ``step-NNNNNN`` in
  one ``rename`` after every file and the manifest are fsynced, so a killed writer leaves no folder of that name
  (only a ``.step-NNNNNN.tmp-<pid>-…`` folder, which nothing reads and the next writer sweeps);
* a reader trusts a checkpoint only after :func:`read_checkpoint` recomputed its weights' sha256 and found the
  manifest's;
* the checkpoints of a root form one chain ``step-000000`` … ``step-N``: each names its predecessor's weights as
  its parent (:func:`checkpoint_chain`), so what the chain consumed is the union of its manifests' ``consumed``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

from tasks.checks import is_hex_digest
from tasks.errors import ConflictError, StorageIntegrityError, UsageError
from tasks.models.bundled import check_model_folder
from tasks.models.provenance import hashed_weights

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "rollout-ledger-checkpoint"
CHECKPOINT_VERSION = 1
MANIFEST_NAME = "checkpoint.json"
STEP_FOLDER = re.compile(r"step-(\d{6})")
TEMP_FOLDER = re.compile(r"\.step-\d{6}\.tmp-(\d+)-[0-9a-f]+")
MANIFEST_KEYS = ("format", "version", "step", "weight_version", "weights_sha256", "parent", "consumed", "created_at")


class MalformedCheckpointError(StorageIntegrityError):
    """A folder that is not a checkpoint this code wrote: no manifest, bad JSON, another format or version, a field
    missing or of the wrong type, or a chain whose links do not hold; the message names the folder and the field."""

    reason = "malformed_checkpoint"


class CheckpointWeightsMismatchError(StorageIntegrityError):
    """The weights in a checkpoint's folder do not hash to the sha256 its manifest names (changed or torn)."""

    reason = "checkpoint_weights_mismatch"


class NoCheckpointError(UsageError):
    """The checkpoints root holds no checkpoint (make checkpoint 0 first: ``rollout-ledger checkpoint-zero``)."""

    reason = "no_checkpoint"


class CheckpointConflictError(ConflictError):
    """A checkpoint of that step already exists with other weights (another trainer wrote it first)."""

    reason = "checkpoint_conflict"


def step_folder_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass(frozen=True)
class ParentCheckpoint:
    """The checkpoint a step started from: its folder (as the trainer saw it) and its weights' sha256."""

    folder: str
    weights_sha256: str


@dataclass(frozen=True)
class ConsumedDataset:
    """A published dataset a step trained on: the batch's URL and id, and the sha256 of its ``_COMMITTED.json``."""

    batch_url: str
    batch_id: str
    dataset_sha256: str


@dataclass(frozen=True)
class CheckpointManifest:
    """``checkpoint.json``: what the module docstring shows, checked on construction."""

    step: int
    weight_version: int
    weights_sha256: str
    parent: ParentCheckpoint | None
    consumed: tuple[ConsumedDataset, ...]
    created_at: str

    def __post_init__(self) -> None:
        for name in ("step", "weight_version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        shas = [self.weights_sha256] + ([self.parent.weights_sha256] if self.parent else [])
        shas += [c.dataset_sha256 for c in self.consumed]
        if not all(isinstance(s, str) and is_hex_digest(s) for s in shas):
            raise ValueError("every sha256 must be 64 lowercase hex digits")
        if (self.parent is None) != (self.step == 0):
            raise ValueError(f"checkpoint 0 and only it has no parent (step {self.step}, parent {self.parent})")
        if self.step == 0 and self.consumed:
            raise ValueError("checkpoint 0 consumed nothing")
        if self.parent is not None and not (isinstance(self.parent.folder, str) and self.parent.folder):
            raise ValueError(f"parent.folder must be a non-empty string, got {self.parent.folder!r}")
        for item in self.consumed:
            if not (isinstance(item.batch_url, str) and item.batch_url and isinstance(item.batch_id, str)):
                raise ValueError(f"consumed: batch_url and batch_id must be strings, got {item}")
        shas = [c.dataset_sha256 for c in self.consumed]
        if len(set(shas)) != len(shas):
            raise ValueError("consumed names a dataset twice")
        try:
            datetime.fromisoformat(self.created_at)
        except (TypeError, ValueError):
            raise ValueError(f"created_at must be ISO-8601, got {self.created_at!r}") from None

    def to_json(self) -> str:
        parent = None if self.parent is None else vars(self.parent)
        body = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "step": self.step,
            "weight_version": self.weight_version,
            "weights_sha256": self.weights_sha256,
            "parent": parent,
            "consumed": [vars(c) for c in self.consumed],
            "created_at": self.created_at,
        }
        return json.dumps(body, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str) -> Self:
        """The manifest in ``text``; :class:`MalformedCheckpointError` naming ``source`` and the field otherwise."""

        def fail(detail: str) -> MalformedCheckpointError:
            return MalformedCheckpointError(f"checkpoint {source}: {detail}")

        try:
            raw = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise fail(f"{MANIFEST_NAME} is not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise fail(f"{MANIFEST_NAME} is not a JSON object")
        if raw.get("format") != CHECKPOINT_FORMAT:
            raise fail(f"format is {raw.get('format')!r}, not {CHECKPOINT_FORMAT!r}")
        if raw.get("version") != CHECKPOINT_VERSION:
            raise fail(f"version {raw.get('version')!r} is not one this code reads ({CHECKPOINT_VERSION})")
        if sorted(raw) != sorted(MANIFEST_KEYS):
            raise fail(f"fields {sorted(raw)}, expected {sorted(MANIFEST_KEYS)}")
        try:
            parent = raw["parent"]
            consumed = raw["consumed"]
            if parent is not None and (not isinstance(parent, dict) or sorted(parent) != ["folder", "weights_sha256"]):
                raise ValueError(f"parent must be null or {{folder, weights_sha256}}, got {parent!r}")
            keys = ["batch_id", "batch_url", "dataset_sha256"]
            if not isinstance(consumed, list) or not all(isinstance(c, dict) and sorted(c) == keys for c in consumed):
                raise ValueError(f"consumed must be a list of {{{', '.join(keys)}}}")
            return cls(
                step=raw["step"],
                weight_version=raw["weight_version"],
                weights_sha256=raw["weights_sha256"],
                parent=None if parent is None else ParentCheckpoint(**parent),
                consumed=tuple(ConsumedDataset(**c) for c in consumed),
                created_at=raw["created_at"],
            )
        except (TypeError, ValueError) as exc:
            raise fail(str(exc)) from None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder and its manifest (read by :func:`read_checkpoint`)."""

    folder: Path
    manifest: CheckpointManifest

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def weights_sha256(self) -> str:
        return self.manifest.weights_sha256

    @property
    def weight_version(self) -> int:
        return self.manifest.weight_version


def read_checkpoint(folder: str | Path, *, verify_weights: bool = True) -> Checkpoint:
    """The checkpoint in ``folder``, its manifest checked and (``verify_weights``) its weights' sha256 recomputed.

    Raises :class:`MalformedCheckpointError` for a folder without a readable manifest of this format, and
    :class:`CheckpointWeightsMismatchError` when the weights do not hash to the manifest's sha256.
    """
    path = Path(folder)
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise MalformedCheckpointError(f"checkpoint {path}: no {MANIFEST_NAME} (not a checkpoint, or not one yet)")
    manifest = CheckpointManifest.from_json(manifest_path.read_bytes(), source=str(path))
    if STEP_FOLDER.fullmatch(path.name) and int(path.name[5:]) != manifest.step:
        raise MalformedCheckpointError(f"checkpoint {path}: its manifest says step {manifest.step}")
    if verify_weights:
        found = hashed_weights(path)
        if found != manifest.weights_sha256:
            raise CheckpointWeightsMismatchError(
                f"checkpoint {path}: its weights hash to {found or 'nothing (no weight files)'}, its manifest names "
                f"{manifest.weights_sha256}: the folder was changed or is incomplete; do not load it"
            )
    return Checkpoint(folder=path, manifest=manifest)


def checkpoint_folders(root: str | Path) -> list[Path]:
    """The ``step-NNNNNN`` folders under ``root``, by step (temporary folders are never among them)."""
    path = Path(root)
    if not path.is_dir():
        return []
    return sorted((p for p in path.iterdir() if STEP_FOLDER.fullmatch(p.name) and p.is_dir()), key=lambda p: p.name)


def checkpoint_chain(root: str | Path) -> list[Checkpoint]:
    """Every checkpoint under ``root``, step 0 to the latest, each link checked (the latest's weights hashed too).

    Step ``k`` must be the folder ``step-k``, with ``step-(k-1)``'s weights as its parent; a gap, a second
    checkpoint 0 or a parent that does not match is :class:`MalformedCheckpointError`. Raises
    :class:`NoCheckpointError` when ``root`` holds none.
    """
    folders = checkpoint_folders(root)
    if not folders:
        raise NoCheckpointError(
            f"{root} holds no checkpoint (no step-NNNNNN folder): make checkpoint 0 with "
            "'rollout-ledger checkpoint-zero --model REF --out DIR'"
        )
    chain: list[Checkpoint] = []
    for index, folder in enumerate(folders):
        checkpoint = read_checkpoint(folder, verify_weights=index == len(folders) - 1)
        if checkpoint.step != index:
            raise MalformedCheckpointError(f"checkpoint {folder}: expected step {index} (the chain has a gap)")
        if index > 0:
            parent, before = checkpoint.manifest.parent, chain[-1]
            if parent is None or parent.weights_sha256 != before.weights_sha256:
                raise MalformedCheckpointError(
                    f"checkpoint {folder}: its parent is {parent}, not {before.folder.name} "
                    f"(weights {before.weights_sha256})"
                )
        chain.append(checkpoint)
    return chain


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def write_checkpoint(
    root: str | Path,
    *,
    step: int,
    weight_version: int,
    parent: ParentCheckpoint | None,
    consumed: Sequence[ConsumedDataset],
    build: Callable[[Path], None],
) -> Checkpoint:
    """Write ``{root}/step-NNNNNN`` atomically: ``build(tmp)`` writes the Hugging Face files into an empty temporary
    sibling, the manifest is added with the weights' sha256, everything is fsynced, then one rename publishes it.

    A folder of that step already there is :class:`CheckpointConflictError` (nothing is replaced); a crash before
    the rename leaves no ``step-NNNNNN`` folder. Temporary folders of writers that are no longer running are
    removed first.
    """
    root_path = Path(root)
    root_path.mkdir(parents=True, exist_ok=True)
    sweep_temporary_folders(root_path)
    name = step_folder_name(step)
    target = root_path / name
    if target.exists():
        raise CheckpointConflictError(f"checkpoint {target} already exists; nothing was written")
    tmp = root_path / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        build(tmp)
        sha = hashed_weights(tmp)
        if sha is None:
            raise MalformedCheckpointError(f"checkpoint {target}: the build wrote no weight files")
        manifest = CheckpointManifest(
            step=step,
            weight_version=weight_version,
            weights_sha256=sha,
            parent=parent,
            consumed=tuple(consumed),
            created_at=now_iso(),
        )
        (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
        _fsync_tree(tmp)
        try:
            tmp.rename(target)  # a directory onto an existing non-empty one fails: the first writer wins
        except OSError as exc:
            if target.exists():
                raise CheckpointConflictError(f"checkpoint {target} was written by another trainer first") from exc
            raise
        _fsync_dir(root_path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("wrote checkpoint %s (step %d, weights %s)", target, step, sha[:12])
    return Checkpoint(folder=target, manifest=manifest)


def checkpoint_zero(model_folder: str | Path, out: str | Path) -> Checkpoint:
    """Checkpoint 0 under the checkpoints root ``out`` (``out/step-000000``): the model folder's files, byte for byte.

    Its weights therefore hash as the model's do (a batch planned with that model verifies against it).
    Idempotent: an existing checkpoint 0 of the same weights is returned as it is; one of other weights is
    :class:`CheckpointConflictError`.
    """
    source = check_model_folder(Path(model_folder))
    expected = hashed_weights(source)
    existing = Path(out) / step_folder_name(0)
    if existing.exists():
        checkpoint = read_checkpoint(existing)
        if checkpoint.weights_sha256 != expected:
            raise CheckpointConflictError(
                f"checkpoint {existing} holds weights {checkpoint.weights_sha256}, not {source}'s ({expected})"
            )
        log.info("checkpoint 0 %s already holds %s's weights", existing, source)
        return checkpoint

    def copy(tmp: Path) -> None:
        for file in sorted(source.iterdir()):
            if file.is_file() and file.name != MANIFEST_NAME:
                shutil.copyfile(file, tmp / file.name)

    checkpoint = write_checkpoint(out, step=0, weight_version=0, parent=None, consumed=(), build=copy)
    if checkpoint.weights_sha256 != expected:  # the copy differs from its source: never keep it
        raise CheckpointWeightsMismatchError(f"checkpoint {checkpoint.folder}: copied weights changed while copying")
    return checkpoint


def sweep_temporary_folders(root: Path) -> list[Path]:
    """Remove the temporary folders of checkpoint writers whose process is gone (this host's); return them."""
    removed = []
    for path in root.iterdir():
        match = TEMP_FOLDER.fullmatch(path.name)
        if match and path.is_dir() and not _pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d unfinished checkpoint folder(s) of stopped writers: %s", len(removed), removed)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_tree(folder: Path) -> None:
    for file in folder.iterdir():
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe(checkpoint: Checkpoint) -> dict[str, Any]:
    """The checkpoint as a JSON-able summary (CLI output)."""
    manifest = json.loads(checkpoint.manifest.to_json())
    return {"folder": str(checkpoint.folder), **manifest}
