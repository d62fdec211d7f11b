"""The in-process vLLM engine a benchmark script runs its batches on: started once, on a background loop, and closed.

Imported by the bench scripts (``from bench.vllm_engine import started_engine``, with the repository
root on ``sys.path``), so each starts, times and closes its engine the same way.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tasks.engines import create_engine
from tasks.engines.background import BackgroundLoop
from tasks.engines.base import Engine


@contextlib.contextmanager
def started_engine(
    folder: Path, *, label: str, options: Mapping[str, Any], weight_version: int
) -> Iterator[tuple[Engine, BackgroundLoop]]:
    """A vLLM engine on the model in ``folder`` and the loop it runs on; prints its start-up time under ``label``,
    and closes it on the way out."""
    with BackgroundLoop("bench-engine") as loop:
        started = time.perf_counter()
        engine = loop.run(
            create_engine("vllm", model_path=folder, options=dict(options), weight_version=weight_version), timeout=900
        )
        print(f"vLLM engine on {label} started in {time.perf_counter() - started:.0f}s", flush=True)
        try:
            yield engine, loop
        finally:
            loop.run(engine.close(), timeout=120)
