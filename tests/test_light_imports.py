"""Importing an entry module loads only the heavy packages its own work needs at import.

Each entry is imported in a fresh interpreter, as a worker, a CLI or the DAG processor starts it.
Watched: the web stack (FastAPI, Starlette, uvicorn: the gateway's), vLLM, Great Expectations and
PyTorch. An entry's allowed set names those its module-level code needs; everything else is
imported inside the function that uses it (docs/architecture.md §11). ``tasks.generate`` has its
own test (tests/generation/test_generate_imports.py); tests/orchestration/test_dag_parse.py times
the DAG parse and watches the data stack, and the DAG entry here adds the web stack.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WATCHED = frozenset({"fastapi", "starlette", "uvicorn", "vllm", "great_expectations", "torch"})
NOTHING: frozenset[str] = frozenset()
ENTRIES: dict[str, frozenset[str]] = {
    "tasks.plan": NOTHING,
    "tasks.finalize.stage": NOTHING,
    "tasks.validate.stage": NOTHING,  # Great Expectations inside the step
    "tasks.publish": NOTHING,
    "tasks.status": NOTHING,
    "tasks.pipeline": NOTHING,
    "tasks.demo": NOTHING,  # built-in environments: no gateway
    "tasks.cli.main": NOTHING,
    "tasks.report": NOTHING,
    "tasks.engines.registry": NOTHING,  # planning checks engine options on any machine
    "tasks.engines.vllm.engine": NOTHING,  # vLLM inside create
    "tasks.engines.vllm_server.engine": NOTHING,
    "tasks.engines.megatron": NOTHING,
    "tasks.engines.megatron.engine": frozenset({"torch"}),  # the weight mapping is PyTorch; megatron-core inside
    "tasks.trainer.collate": frozenset({"torch"}),  # batches are torch tensors
    "dags/rollout_batch.py": NOTHING,  # parsed as the DAG processor does, after Airflow's SDK
}
PROBE = """
import importlib, json, runpy, sys
entry = sys.argv[1]
if entry.endswith(".py"):
    sys.path.insert(0, "dags")
    import airflow.sdk  # noqa: F401  (the DAG processor has it loaded)
    runpy.run_path(entry, run_name="parsed")
else:
    importlib.import_module(entry)
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def _top_level_modules_after_importing(entry: str, airflow_home: Path) -> set[str]:
    env = {**os.environ, "AIRFLOW_HOME": str(airflow_home), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, entry],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(("entry", "allowed"), ENTRIES.items(), ids=list(ENTRIES))
def test_an_entry_loads_no_heavy_package_its_work_does_not_need(
    entry: str, allowed: frozenset[str], tmp_path: Path
) -> None:
    loaded = _top_level_modules_after_importing(entry, tmp_path) & WATCHED
    assert loaded <= allowed, f"{entry} loads {sorted(loaded - allowed)}; import them where they are used"
