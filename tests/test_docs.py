"""The user docs list every stable reason string and every dataset column the code defines."""

from __future__ import annotations

from pathlib import Path

from tasks.capture.faults import FAILURE_REASONS
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

    pages = {"vllm": "generation.md", "vllm_server": "servers.md", "megatron": "megatron.md"}
    assert set(pages) == set(engine_names()), "name the doc page of each registered engine here"
    for name, page in pages.items():
        text = (DOCS / page).read_text()
        missing = [option for option in options_model(name).model_fields if f"`{option}`" not in text]
        assert not missing, f"docs/{page} does not list the {name} engine option(s) {missing}"


def test_architecture_doc_maps_every_layer_and_every_cited_section_exists():
    import re
    import tomllib

    root = DOCS.parent
    text = (DOCS / "architecture.md").read_text()
    sections = set(re.findall(r"^#{2,3} (\d+)\.", text, re.M)) | set(re.findall(r"\*\*(\d+\.\d+) ", text))
    cited: set[str] = set()
    for path in [
        *root.glob("tasks/**/*.py"),
        *root.glob("tests/**/*.py"),
        *root.glob("bench/*.py"),
        *root.glob("**/*.md"),
    ]:
        if ".venv" in path.parts:
            continue
        for reference in re.findall(r"architecture\.md §([\d.\-]+(?:, §[\d.\-]+)*)", path.read_text()):
            cited |= {part.split("-")[0] for part in re.findall(r"[\d.]+\d|\d", reference)}
    assert cited and not cited - sections, f"cited sections {sorted(cited - sections)} are not in docs/architecture.md"
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in config if c["type"] == "layers" and "containers" not in c]
    modules = {name.strip() for layer in layers for name in re.split(r"[|:]", layer)}
    for module in modules:
        short = module.removeprefix("tasks.")
        assert f"`{short}`" in text or f"tasks/{short}" in text, f"docs/architecture.md §11 does not map {module}"
    packages = {p.parent.name for p in (root / "tasks").glob("*/__init__.py")} | {
        p.stem for p in (root / "tasks").glob("*.py") if p.stem != "__init__"
    }
    assert not packages - {m.removeprefix("tasks.") for m in modules}, "a tasks module is in no import layer"


def test_agents_doc_lists_every_agent_failure_root_reason_and_refused_field():
    from tasks.capture.graph import ROOT_REASONS
    from tasks.environments.agents import AGENT_FAILURES
    from tasks.gateway.protocol import REFUSED_FIELDS

    text = (DOCS / "agents.md").read_text()
    names = [*AGENT_FAILURES, *ROOT_REASONS, *REFUSED_FIELDS]
    assert not [name for name in names if f"`{name}`" not in text], "docs/agents.md is missing some"
