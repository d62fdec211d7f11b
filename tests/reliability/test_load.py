"""Load: one batch of >= 2,000 rollouts through staging, ledger and finalization, on local disk and S3 (moto).

The engine is the tests' FAKE (:class:`tests.generation.fakes.FakeScriptedEngine`): no inference,
instant scripted replies tokenized by the real bundled tokenizer. Everything else is real: plan,
generate (claims, staging segments, ledger, receipts, shard markers), finalize, both validation
suites and publish (``finalize_and_publish``).

Checked: every planned rollout exactly once in the dataset, rows = trainable + masked with every
masked row's reason named, the shard markers' counts add up, and the RSS growth over the whole
run stays under :data:`RSS_GROWTH_BOUND_MB` (a background thread samples this process's RSS; the
growth is peak minus the RSS before planning). :func:`run_load` is shared with ``bench/load.py``,
which prints the same figures.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pyarrow as pa
import pytest

from tasks.batch import Batch
from tasks.config import BatchConfig, ModelSpec
from tasks.sampling import SamplingSettings

RSS_GROWTH_BOUND_MB = 1024  # generous: the run holds at most max_in_flight rollouts plus one dataset part
NUM_TASKS, GROUP_SIZE, SHARDS = 1000, 2, 4  # 2,000 rollouts
FAIL_EVERY = 50


def load_config(num_tasks: int = NUM_TASKS, group_size: int = GROUP_SIZE, shards: int = SHARDS) -> BatchConfig:
    """A multi-turn guess_number batch; every reply is a small guess, so rollouts win or run out of turns."""
    return BatchConfig(
        batch_id="b-load",
        environment="guess_number",
        environment_options={"lo": 1, "hi": 8},
        num_tasks=num_tasks,
        group_size=group_size,
        shards=shards,
        model=ModelSpec(reference="fake-model"),
        sampling=SamplingSettings(temperature=1.0, max_tokens=16),
        max_turns=3,
        max_in_flight=64,
        seed=7,
    )


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds in a daemon thread; ``peak_mb`` is the highest seen."""

    def __init__(self, interval: float = 0.02) -> None:
        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.start_mb = self._rss_mb()
        self.peak_mb = self.start_mb
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def _rss_mb(self) -> float:
        return self._process.memory_info().rss / 2**20

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak_mb = max(self.peak_mb, self._rss_mb())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, self._rss_mb())


@contextmanager
def timed(seconds: dict[str, float], stage: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[stage] = round(time.perf_counter() - started, 2)


def fail_some(request: Any) -> BaseException | None:
    """About one first call in :data:`FAIL_EVERY` fails (a named ``engine_error``), so some rows are masked."""
    from tasks.errors import EngineError

    if request.request_id.endswith(".c000") and request.seed % FAIL_EVERY == 0:
        return EngineError("fake engine: scripted failure")
    return None


def run_load(
    root_url: str,
    tokenizer: Any,
    config: BatchConfig,
    *,
    publish: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Plan, generate every shard on the FAKE engine, finalize (and validate + publish); the figures.

    Returns a dict of figures plus ``_rows`` (the dataset's rollout_id / sample_mask / mask_reason
    columns) and ``_markers`` (each shard marker's counts) for the assertions.
    """
    from tasks.finalize.stage import finalize_batch
    from tasks.generate import generate_shards
    from tasks.pipeline import finalize_and_publish
    from tasks.plan import plan_batch
    from tasks.storage.dataset_manifest import read_dataset_part, read_staged_marker
    from tasks.storage.marker import read_marker
    from tests.generation.fakes import FakeScriptedEngine

    seconds: dict[str, float] = {}
    engine = FakeScriptedEngine(
        tokenizer, reply=lambda request: str(request.seed % 8 + 1), fail=fail_some, record=False
    )
    with RssSampler() as rss:
        with timed(seconds, "plan"):
            plan_batch(Batch.open(root_url, config.batch_id, storage_options), config)
        with timed(seconds, "generate"):
            summaries = generate_shards(
                Batch.open(root_url, config.batch_id, storage_options),
                range(config.shards),
                engine=engine,
                run=asyncio.run,
                progress=False,
            )
        generate_peak = rss.peak_mb
        with timed(seconds, "finalize"):
            staged = finalize_batch(Batch.open(root_url, config.batch_id, storage_options))
        if publish:
            with timed(seconds, "validate_publish"):
                result = finalize_and_publish(Batch.open(root_url, config.batch_id, storage_options))
            assert result.published is not None and result.published.created
        store = Batch.open(root_url, config.batch_id, storage_options).store
        markers = [read_marker(store, shard) for shard in range(config.shards)]
        marker = read_staged_marker(store)
        columns = ["rollout_id", "sample_mask", "mask_reason"]
        table = pa.concat_tables(read_dataset_part(store, part).select(columns) for part in marker.parts)
    return {
        "storage": root_url.split("://", maxsplit=1)[0] if "://" in root_url else "local",
        "planned_rollouts": config.num_tasks * config.group_size,
        "shards": config.shards,
        "rollouts": sum(s.rollouts for s in summaries),
        "ok": sum(s.ok for s in summaries),
        "calls": sum(s.calls for s in summaries),
        "prompt_tokens": engine.prompt_tokens,
        "generated_tokens": engine.generated_tokens,
        "rows": staged.marker.rows,
        "trainable_rows": staged.marker.trainable_rows,
        "mask_reasons": dict(Counter(r for r in table.column("mask_reason").to_pylist() if r is not None)),
        "dataset_parts": len(marker.parts),
        "seconds": seconds,
        "rss_start_mb": round(rss.start_mb),
        "rss_peak_generate_mb": round(generate_peak),
        "rss_peak_mb": round(rss.peak_mb),
        "rss_growth_mb": round(rss.peak_mb - rss.start_mb),
        "_rows": table.to_pydict(),
        "_markers": [m.counts for m in markers],
    }


def figures_line(figures: dict[str, Any]) -> str:
    """The figures as one JSON line (without the assertion inputs)."""
    return json.dumps({k: v for k, v in figures.items() if not k.startswith("_")})


def check_load(figures: dict[str, Any]) -> None:
    planned = figures["planned_rollouts"]
    rows = figures["_rows"]
    ids = rows["rollout_id"]
    assert len(ids) == len(set(ids)) == planned, "every planned rollout exactly once in the dataset"
    assert figures["rows"] == len(ids)
    masked = [reason for mask, reason in zip(rows["sample_mask"], rows["mask_reason"], strict=True) if mask == 0]
    assert figures["trainable_rows"] + len(masked) == figures["rows"]
    assert sum(rows["sample_mask"]) == figures["trainable_rows"]
    assert masked, "the scripted engine failures mask some rows"
    assert all(isinstance(reason, str) and reason for reason in masked), Counter(masked)
    assert all(reason is None for mask, reason in zip(rows["sample_mask"], rows["mask_reason"], strict=True) if mask)
    counts = figures["_markers"]
    assert sum(c.rollouts for c in counts) == figures["rollouts"] == planned
    assert all(c.ok + c.poisoned + c.failed == c.rollouts for c in counts)
    assert sum(c.calls_used for c in counts) == figures["calls"]
    assert sum(c.adopted_rollouts for c in counts) == 0
    assert figures["rss_growth_mb"] < RSS_GROWTH_BOUND_MB, figures_line(figures)


@pytest.mark.slow
def test_load_on_local_disk(tmp_path, tokenizer):
    figures = run_load(str(tmp_path / "runs"), tokenizer, load_config())
    print("load figures:", figures_line(figures))
    check_load(figures)


@pytest.mark.slow
@pytest.mark.e2e
def test_load_on_s3(s3_bucket, tokenizer):
    figures = run_load(f"{s3_bucket}/runs", tokenizer, load_config())
    print("load figures:", figures_line(figures))
    check_load(figures)
