"""Generate-stage fixtures: the real bundled tokenizer and a planned batch on local disk."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.models import bundled


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The real SmolLM2-135M-Instruct tokenizer, converted from the bundled GGUF once per session."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(bundled.HOME_ENV, str(tmp_path_factory.mktemp("rollout-ledger-home")))
        return bundled.load_bundled_tokenizer()
