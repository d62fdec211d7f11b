"""docs/validation.md lists every expectation of both suites, whatever the batch config builds."""

from __future__ import annotations

from pathlib import Path

from tasks.validate.suites import all_expectation_names

DOC = Path(__file__).resolve().parents[2] / "docs" / "validation.md"


def test_validation_doc_lists_every_expectation_of_both_suites():
    text = DOC.read_text()
    for suite, names in all_expectation_names().items():
        section = text.split(f"## {suite.capitalize()} suite", 1)[1].split("\n## ", 1)[0]
        missing = [name for name in names if f"| `{name}` |" not in section]
        assert not missing, f"docs/validation.md's {suite} suite table does not list {missing}"
