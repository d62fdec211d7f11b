"""Portable model references (docs/architecture.md §12): what a batch config records, and how a worker resolves it.

A reference is ``bundled:<name>`` (the model shipped with the project, converted once into
each worker's cache) or the absolute path / ``file://`` URI of a Hugging Face model folder that
every worker can read. Never one host's cache path: a worker resolves the reference itself,
then :func:`check_provenance` compares the folder's hashes with the ones the plan recorded
before any engine starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from tasks.errors import ModelMismatchError, ModelReferenceError
from tasks.models.bundled import MODEL_NAME, check_model_folder, ensure_bundled_model
from tasks.models.provenance import model_provenance

BUNDLED_PREFIX = "bundled:"
BUNDLED_REFERENCE = f"{BUNDLED_PREFIX}{MODEL_NAME}"
BUNDLED_MODELS = (MODEL_NAME,)


def model_reference(given: str | None) -> str:
    """The portable reference for what a user passed: ``None`` is the bundled model, a path becomes absolute."""
    if given is None or given == BUNDLED_REFERENCE:
        return BUNDLED_REFERENCE
    if given.startswith(BUNDLED_PREFIX):
        raise ModelReferenceError(
            f"unknown bundled model {given!r}; bundled: {[BUNDLED_PREFIX + m for m in BUNDLED_MODELS]}"
        )
    if given.startswith("file://"):
        return given
    if "://" in given:
        raise ModelReferenceError(
            f"model {given!r}: only local folders (a path or file:// URI every worker can read) are supported; "
            "copy or mount the model folder on each worker"
        )
    return str(Path(given).expanduser().resolve())


def resolve_model_reference(reference: str) -> Path:
    """The local, checked model folder a reference names on this worker (converting the bundled model once)."""
    if reference == BUNDLED_REFERENCE:
        return ensure_bundled_model()
    if reference.startswith(BUNDLED_PREFIX) or ("://" in reference and not reference.startswith("file://")):
        model_reference(reference)  # raises the error naming what is wrong
    path = Path(reference.removeprefix("file://"))
    if not path.is_absolute():
        raise ModelReferenceError(f"model reference {reference!r} is a relative path; plan records absolute ones")
    return check_model_folder(path)


def is_bundled(reference: str) -> bool:
    return reference.startswith(BUNDLED_PREFIX)


def check_provenance(folder: Path, expected: Mapping[str, str], *, reference: str) -> None:
    """Refuse ``folder`` unless its weights, tokenizer and chat template hash to ``expected`` (empty: not recorded)."""
    actual = model_provenance(folder)
    differ = [name for name, value in expected.items() if value and actual[name] != value]
    if differ:
        details = "; ".join(f"{n}: planned {expected[n][:12]}…, found {actual[n][:12]}…" for n in differ)
        raise ModelMismatchError(
            f"model {reference} resolved to {folder} on {os.uname().nodename}, which is not the planned model "
            f"({details}); give this worker the planned model, or re-plan under a new batch id"
        )
