"""The served Hugging Face tokenizer under the names megatron-core's text generation controller calls.

Invariant: megatron's end-of-document id is the tokenizer's eos id, the one the engine stops at;
tokenizing adds no special tokens (prompts arrive as ids, already rendered).
"""

from __future__ import annotations

from typing import Any


class MegatronTokenizer:
    """A Hugging Face tokenizer as megatron's controller uses it (``eod``, ``bos``, ``detokenize``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.eod = int(tokenizer.eos_token_id)
        self.bos = tokenizer.bos_token_id
        self.vocab_size = len(tokenizer)

    def tokenize(self, text: str) -> list[int]:
        """``text`` as ids, without special tokens."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """``ids`` as text."""
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
