"""Capture fixtures: the bundled SmolLM2 tokenizer, converted once per test session."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.models import bundled


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The real SmolLM2-135M-Instruct tokenizer and chat template, from the bundled GGUF.

    Converted into a per-session cache directory (a few seconds), never from the Hub.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(bundled.HOME_ENV, str(tmp_path_factory.mktemp("rollout-ledger-home")))
        return bundled.load_bundled_tokenizer()
