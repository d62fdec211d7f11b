"""Importing the generate stage and the capture path loads no gateway, web server, engine or validation library.

A built-in (stepped) environment's attempt imports the agent gateway (FastAPI, starlette, uvicorn)
only where an agent runs (``rollouts._episodes``); vLLM, torch and Great Expectations load where
they are used. Imported in a fresh interpreter, as a worker starts it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("fastapi", "starlette", "uvicorn", "vllm", "great_expectations", "torch")
IMPORTED = ("tasks.generate", "tasks.generate.rollouts", "tasks.generate.worker", "tasks.capture.calls")


@pytest.fixture(scope="module")
def loaded() -> list[str]:
    """Every module loaded once ``IMPORTED`` are imported in a fresh interpreter."""
    script = f"import json, sys, {', '.join(IMPORTED)}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_generate_and_capture_load_no_web_server_engine_or_validation_library(loaded):
    assert [name for name in HEAVY if name in loaded] == []


def test_generate_loads_the_agent_gateway_only_where_an_agent_runs(loaded):
    assert [name for name in loaded if name.startswith(("tasks.gateway", "tasks.generate.agent_rollouts"))] == []
