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


def test_airflow_doc_lists_every_trigger_form_field():
    from tasks.orchestration.form import form_fields

    text = (DOCS / "airflow.md").read_text()
    assert not [name for name in form_fields() if f"`{name}`" not in text]
