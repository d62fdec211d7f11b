"""A model's provenance: digests of its weights, tokenizer and chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.errors import ModelFolderError
from tasks.models.bundled import weight_files
from tasks.models.provenance import chat_template_text, model_provenance, tokenizer_files


def _folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model-00001-of-00002.safetensors").write_bytes(b"a" * 10)
    (path / "model-00002-of-00002.safetensors").write_bytes(b"b" * 10)
    (path / "tokenizer.json").write_text('{"vocab": 1}')
    (path / "tokenizer_config.json").write_text('{"eos_token": "<e>"}')
    (path / "chat_template.jinja").write_text("{{ messages }}")
    return path


def test_provenance_covers_every_weight_shard_tokenizer_file_and_the_template(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m")
    found = model_provenance(folder)
    assert [p.name for p in weight_files(folder)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert [p.name for p in tokenizer_files(folder)] == ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(found) == ["chat_template_sha256", "tokenizer_sha256", "weights_sha256"]
    assert all(len(value) == 64 for value in found.values())


def test_provenance_does_not_depend_on_where_the_folder_lives(tmp_path: Path) -> None:
    first = _folder(tmp_path / "a")
    second = tmp_path / "b"
    shutil.copytree(first, second)
    assert model_provenance(first) == model_provenance(second)


@pytest.mark.parametrize(
    ("file", "changed"),
    [
        ("model-00002-of-00002.safetensors", "weights_sha256"),
        ("tokenizer.json", "tokenizer_sha256"),
        ("chat_template.jinja", "chat_template_sha256"),
    ],
)
def test_changing_one_byte_changes_exactly_its_digest(tmp_path: Path, file: str, changed: str) -> None:
    folder = _folder(tmp_path / "m")
    before = model_provenance(folder)
    target = folder / file
    target.write_bytes(target.read_bytes()[:-1] + b"!")
    after = model_provenance(folder)
    digests = ("weights_sha256", "tokenizer_sha256", "chat_template_sha256")
    assert [k for k in digests if before[k] != after[k]] == [changed]


def test_chat_template_falls_back_to_tokenizer_config_and_may_be_absent(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m")
    (folder / "chat_template.jinja").unlink()
    assert chat_template_text(folder) is None
    assert model_provenance(folder)["chat_template_sha256"] == ""
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    assert chat_template_text(folder) == "{{ x }}"


def test_provenance_of_an_incomplete_folder_names_the_reason(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ModelFolderError) as caught:
        model_provenance(folder)
    assert caught.value.reason == "missing_config"
