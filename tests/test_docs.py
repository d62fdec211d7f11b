"""The user docs list every stable reason string and every dataset column the code defines."""

from __future__ import annotations

from pathlib import Path

from tasks.capture.calls import FAILURE_REASONS
from tasks.finalize import reasons
from tasks.records.dataset_row import DatasetRow

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_finalization_doc_lists_every_reason_and_column():
    text = (DOCS / "finalization.md").read_text()
    missing = [r for r in reasons.ALL_REASONS if f"`{r}`" not in text]
    assert not missing, f"docs/finalization.md does not list {missing}"
    columns = [c for c in DatasetRow.column_names() if f"`{c}`" not in text]
    assert not columns, f"docs/finalization.md does not describe {columns}"


def test_generation_doc_lists_every_capture_failure_reason():
    text = (DOCS / "generation.md").read_text()
    assert not [r for r in FAILURE_REASONS if f"`{r}`" not in text]


def test_engine_docs_list_every_option_of_every_registered_engine():
    from tasks.engines.registry import engine_names, options_model

    pages = {"vllm": "generation.md", "megatron": "megatron.md"}
    assert set(pages) == set(engine_names()), "name the doc page of each registered engine here"
    for name, page in pages.items():
        text = (DOCS / page).read_text()
        missing = [option for option in options_model(name).model_fields if f"`{option}`" not in text]
        assert not missing, f"docs/{page} does not list the {name} engine option(s) {missing}"
