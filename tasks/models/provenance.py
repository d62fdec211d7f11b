"""A model's provenance: what a batch records so its rollouts can be tied to exact weights.

docs/architecture.md §12: the batch config carries the model path and the sha256 of its
weights, tokenizer and chat template. Each group of files hashes to one digest that depends
on every file's name and bytes (not on timestamps or the folder's location), so copying a
model folder keeps its provenance and changing any byte of it changes one of the digests.

A model call also names the weights of each version that sampled its tokens (an engine that
knows them puts :func:`weights_extras` in the call's extras, covered by its digest): the sha256
of that version's weights, or ``None`` where nobody hashed them (declared, not verified).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.checks import is_hex_digest
from tasks.models.bundled import check_model_folder, weight_files

PROVENANCE_DOMAIN = b"rollout-ledger-model-files-v1"
# How a batch knows its generating weights are the planned ones (``model.weights`` of its config):
# verified, hashed against the plan where they are loaded; declared, accepted by a server's model name.
WEIGHTS_VERIFIED, WEIGHTS_DECLARED = "verified", "declared, not verified"
WEIGHT_CHECKS = (WEIGHTS_VERIFIED, WEIGHTS_DECLARED)
# The key of a call's extras that maps each weight version of its tokens (as text) to the sha256
# of that version's weights, or to null where they were not hashed.
WEIGHTS_EXTRAS_KEY = "weights_sha256"
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_CHUNK = 1 << 20


def model_provenance(path: str | Path) -> dict[str, str]:
    """Digests of a checked model folder: ``weights_sha256``, ``tokenizer_sha256``, ``chat_template_sha256``.

    Exactly those three keys (the fields of the batch config's model spec besides its path).
    ``chat_template_sha256`` is the sha256 of the template text the tokenizer applies
    (``chat_template.jinja``, else the ``chat_template`` of tokenizer_config.json), or ``""``
    when the model has none.
    """
    folder = check_model_folder(Path(path))
    return {"weights_sha256": files_digest(weight_files(folder)), **tokenizer_provenance(folder)}


def tokenizer_provenance(folder: Path) -> dict[str, str]:
    """``tokenizer_sha256`` and ``chat_template_sha256`` of ``folder`` (as :func:`model_provenance`)."""
    template = chat_template_text(folder)
    return {
        "tokenizer_sha256": files_digest(tokenizer_files(folder)),
        "chat_template_sha256": "" if template is None else hashlib.sha256(template.encode()).hexdigest(),
    }


def hashed_weights(folder: str | Path) -> str | None:
    """The weights sha256 of ``folder`` (as :func:`model_provenance`) when it is a readable folder on this machine
    with weight files; ``None`` otherwise: weights nobody here could hash."""
    path = Path(folder)
    try:
        files = weight_files(path) if path.is_dir() else []
        return files_digest(files) if files else None
    except OSError:
        return None


def weights_extras(by_version: Mapping[int, str | None]) -> dict[str, Any]:
    """A call's extras naming the weights of each version that sampled its tokens (``None``: not hashed)."""
    return {WEIGHTS_EXTRAS_KEY: {str(version): sha for version, sha in sorted(by_version.items())}}


def read_weights_extras(extras: Any) -> dict[int, str | None] | None:
    """What :func:`weights_extras` recorded in ``extras`` (an engine's own extras); ``None`` where it holds none.

    Raises ``ValueError`` for a value of that key that :func:`weights_extras` does not write.
    """
    if not isinstance(extras, dict) or WEIGHTS_EXTRAS_KEY not in extras:
        return None
    named = extras[WEIGHTS_EXTRAS_KEY]
    if not isinstance(named, dict) or not all(
        isinstance(v, str) and v.isascii() and v.isdigit() and (sha is None or is_hex_digest(sha))
        for v, sha in named.items()
    ):
        raise ValueError(f"extras {WEIGHTS_EXTRAS_KEY}: expected version -> sha256 or null, got {str(named)[:200]}")
    return {int(version): sha for version, sha in named.items()}


def tokenizer_files(folder: Path) -> list[Path]:
    """The tokenizer files present in ``folder``, in :data:`TOKENIZER_FILE_NAMES` order."""
    return [folder / name for name in TOKENIZER_FILE_NAMES if (folder / name).is_file()]


def files_digest(files: list[Path]) -> str:
    """sha256 over (name, size, sha256) of each file in name order; names are relative to their folder."""
    hasher = hashlib.sha256(PROVENANCE_DOMAIN)
    for file in sorted(files, key=lambda p: p.name):
        name = file.name.encode()
        hasher.update(len(name).to_bytes(8, "big") + name)
        hasher.update(file.stat().st_size.to_bytes(8, "big") + bytes.fromhex(file_sha256(file)))
    return hasher.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of one file's bytes, read in 1 MiB chunks."""
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def chat_template_text(folder: Path) -> str | None:
    """The chat template a tokenizer loaded from ``folder`` uses, or ``None``."""
    jinja = folder / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
        if template is not None:  # a list of named templates
            return json.dumps(template, sort_keys=True)
    return None
