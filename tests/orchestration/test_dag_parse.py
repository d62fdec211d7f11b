"""Parsing a DAG file or the plugin stays light: each is run in a fresh interpreter, as the DAG processor would.

Airflow re-parses DAG files continuously, so what they import costs on every parse of every
profile. Airflow's own SDK brings fsspec and jinja2; the project adds no heavy package, and no
project module imported at parse time imports fsspec (or another heavy package) at module level.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("numpy", "pyarrow", "pandas", "great_expectations", "torch", "vllm", "transformers", "s3fs", "fsspec")
NEVER_LOADED = tuple(name for name in HEAVY if name != "fsspec")  # Airflow's SDK imports fsspec itself
MAX_PROJECT_PARSE_SECONDS = 2.0  # measured about 0.3 s on 2 busy cores; Airflow's own import is apart
PROBE = """
import json, runpy, sys, time
sys.path.insert(0, {dags!r})
import airflow.sdk  # Airflow's own cost, apart from the file's
before = set(sys.modules)
started = time.perf_counter()
runpy.run_path({path!r}, run_name="parsed")
print(json.dumps({{
    "seconds": time.perf_counter() - started,
    "new": sorted(set(sys.modules) - before),
    "loaded": sorted({{name.split(".")[0] for name in sys.modules}}),
}}))
"""
PARSED_FILES = sorted(  # every DAG file and plugin
    str(path.relative_to(ROOT)) for folder in ("dags", "plugins") for path in (ROOT / folder).glob("*.py")
)


def _parse(path: str, tmp_path: Path) -> dict:
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = PROBE.format(dags=str(ROOT / "dags"), path=str(ROOT / path))
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _module_level_imports(module: str) -> set[str]:
    """Top-level package names ``module``'s source imports outside functions (TYPE_CHECKING blocks excluded)."""
    spec_path = ROOT / (module.replace(".", "/") + ".py")
    if not spec_path.exists():
        spec_path = ROOT / module.replace(".", "/") / "__init__.py"
    names: set[str] = set()
    for node in ast.parse(spec_path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", PARSED_FILES)
def test_parsing_imports_no_heavy_package_and_stays_fast(path, tmp_path):
    parsed = _parse(path, tmp_path)
    assert not set(NEVER_LOADED) & set(parsed["loaded"]), f"{path} loads {set(NEVER_LOADED) & set(parsed['loaded'])}"
    project = [name for name in parsed["new"] if name == "tasks" or name.startswith("tasks.")]
    heavy_importers = {module: _module_level_imports(module) & set(HEAVY) for module in project}
    assert not any(heavy_importers.values()), {m: sorted(h) for m, h in heavy_importers.items() if h}
    assert not {"tasks.batch", "tasks.storage.objects", "tasks.report"} & set(project)
    if path.startswith("dags/"):  # the plugin's time is Airflow's API server modules, loaded once per process
        assert parsed["seconds"] < MAX_PROJECT_PARSE_SECONDS, f"{path}: {parsed['seconds']:.2f} s, modules {project}"
