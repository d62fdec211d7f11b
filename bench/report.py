"""Overview page benchmark: the size of ``reports/index.html`` and how long building it takes.

Builds a batch in a temporary directory (plan; generate with the tests' FAKE scripted engine: no
inference, the real tokenizer, an engine error on some calls and each shard at its own weight
version, so rows are masked and versions spread; real finalize; then a summary per suite, written
as the validation stage writes them but without running Great Expectations, one expectation warned
with examples), or reads the batch ``--root``/``--batch-id`` name, and times on it, in a fresh
process:

* gather: reading the figures (config, manifest, metrics, the per-row profile of the parts,
  summaries, review decision), the first time in the process (lazy imports included);
* render: the page from those figures, the first time in the process (templates compiled) and
  the median of ``--repeat`` more;
* write: ``write_report_index`` end to end (gather, render, the create-once copy, the replace),
  median of ``--repeat``.

``--baseline REV`` also times the page of git revision REV on the same batch, in a process that
imports REV's ``tasks/`` (``git archive``) and its ``tasks/validate/report.py`` (the page before
``tasks/report``), and prints both side by side. Times are wall seconds on this machine: compare
the columns, not runs on other machines. With ``--root`` the page is written into that batch, as
``rollout-ledger validate`` writes it (a baseline's page stays as one more
``reports/index-<sha>.html``).

    python bench/report.py [--tasks 256] [--group-size 4] [--shards 4] [--repeat 5] [--baseline REV]
    python bench/report.py --root ROOT --batch-id ID [--baseline REV]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TREE_ENV = "ROLLOUT_LEDGER_BENCH_TREE"  # the source tree a --measure process imports (this checkout by default)
sys.path.insert(0, os.environ.get(TREE_ENV) or str(ROOT))

BATCH_ID = "bench-report"


def current_page() -> tuple[Callable[[str, str], Any], Callable[[Any], str], Callable[[str, str], str]]:
    """gather, render and write of this tree's ``tasks/report``."""
    from tasks.batch import Batch
    from tasks.report import write_report_index
    from tasks.report.gather import gather_report
    from tasks.report.render import render_report

    return (
        lambda root, batch_id: gather_report(Batch.open(root, batch_id)),
        render_report,
        lambda root, batch_id: write_report_index(Batch.open(root, batch_id)),
    )


def baseline_page() -> tuple[Callable[[str, str], Any], Callable[[Any], str], Callable[[str, str], str]]:
    """gather, render and write of a tree whose page is ``tasks/validate/report.py`` (its own, older API)."""
    from tasks.plan import batch_store
    from tasks.validate import report

    return (
        lambda root, batch_id: report.read_report_inputs(batch_store(root, batch_id)),
        report.render_report,
        report.write_report_index,
    )


PAGES = {"current": current_page, "baseline": baseline_page}


def build(root: str, tasks: int, group_size: int, shards: int) -> str:
    """Plan, generate (fake engine) and finalize a batch, then write both suites' summaries; returns its id."""
    from tasks import layout
    from tasks.batch import Batch
    from tasks.config import BatchConfig, ModelSpec, ValidationSpec
    from tasks.engines.base import EngineError
    from tasks.finalize.stage import FinalizeOptions, finalize_batch
    from tasks.generate import generate_shards
    from tasks.models.bundled import load_bundled_tokenizer
    from tasks.plan import plan_batch
    from tasks.sampling import SamplingSettings
    from tasks.validate.gx_run import ExpectationResult
    from tasks.validate.suites import dataset_suite, lineage_suite
    from tasks.validate.summary import build_summary
    from tests.generation.fakes import FakeScriptedEngine

    config = BatchConfig(
        batch_id=BATCH_ID,
        environment="guess_number",
        environment_options={"lo": 1, "hi": 8},
        num_tasks=tasks,
        group_size=group_size,
        shards=shards,
        model=ModelSpec(reference="fake-model"),
        sampling=SamplingSettings(temperature=1.0, max_tokens=24),
        max_turns=4,
        max_in_flight=64,
        weight_version=3,
    )
    batch = Batch.open(root, BATCH_ID)
    plan_batch(batch, config)
    tokenizer = load_bundled_tokenizer()
    for shard in range(shards):
        engine = FakeScriptedEngine(
            tokenizer,
            reply=lambda request: str(request.seed % 8 + 1),
            fail=lambda r: EngineError("device lost") if r.request_id.endswith(".c002") and r.seed % 7 == 0 else None,
            weight_version=3 + shard,
            record=False,
        )
        generate_shards(batch, [shard], engine=engine, run=asyncio.run, progress=False)
    finalize_batch(batch, FinalizeOptions(audit=False))

    store = batch.store
    thresholds = ValidationSpec()
    for suite in (lineage_suite(thresholds, weight_version=3), dataset_suite(thresholds, on_invalid="mask")):
        results = {spec.name: ExpectationResult(True, 100, 0, (), None) for spec in suite.expectations}
        if suite.name == "dataset":
            warned = next(spec.name for spec in suite.expectations if spec.severity == "warn")
            results[warned] = ExpectationResult(False, 100, 9, tuple(f"r{i:06d}-00" for i in range(5)), None)
        summary = build_summary(
            suite,
            results,
            batch_id=BATCH_ID,
            rows=100,
            thresholds=thresholds,
            gx_version="1.24.1",
            report=f"reports/{suite.name}/run-000/index.html",
            created_at=time.time(),
            run="run-000",
            run_key="0" * 64,
            inputs={},
        )
        store.write_once(layout.suite_summary(suite.name, "run-000"), summary.to_json().encode())
    return BATCH_ID


def measure(page: str, root: str, batch_id: str, repeat: int) -> dict[str, float]:
    """The figures of :data:`PAGES` ``[page]`` on the batch, in this process (meant to be a fresh one)."""
    gather, render, write = PAGES[page]()
    started = time.perf_counter()
    figures = gather(root, batch_id)
    gathered = time.perf_counter() - started
    started = time.perf_counter()
    text = render(figures)
    first = time.perf_counter() - started
    renders, writes = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        render(figures)
        renders.append(time.perf_counter() - started)
    for _ in range(repeat):
        started = time.perf_counter()
        write(root, batch_id)
        writes.append(time.perf_counter() - started)
    return {
        "page bytes": len(text.encode("utf-8")),
        "<svg> plots": text.count("<svg"),
        "gather (first)": gathered,
        "render (first)": first,
        "render (median)": statistics.median(renders),
        "write_report_index (median)": statistics.median(writes),
    }


def measure_in(tree: Path, page: str, root: str, batch_id: str, repeat: int) -> dict[str, float]:
    """:func:`measure` in a fresh process importing ``tree``'s ``tasks``."""
    command = [sys.executable, __file__, "--measure", page, "--root", root, "--batch-id", batch_id]
    done = subprocess.run(
        [*command, "--repeat", str(repeat)],
        env={**os.environ, TREE_ENV: str(tree)},
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"measuring {page} of {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def archive(revision: str, target: Path) -> Path:
    """``tasks/`` of git ``revision`` extracted under ``target``."""
    done = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "tasks"], capture_output=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"--baseline {revision}: {done.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(target, filter="data")
    if not (target / "tasks/validate/report.py").is_file():
        raise SystemExit(f"--baseline {revision}: it has no tasks/validate/report.py (the page before tasks/report)")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=256, help="groups of the batch built (default 256)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5, help="renders and writes timed after the first")
    parser.add_argument("--root", help="measure the batch under this root URL instead of building one")
    parser.add_argument("--batch-id", help="the batch under --root")
    parser.add_argument("--baseline", metavar="REV", help="also time the page of this git revision")
    parser.add_argument("--measure", choices=sorted(PAGES), help=argparse.SUPPRESS)  # one process's measurement
    args = parser.parse_args(argv)
    if bool(args.root) != bool(args.batch_id):
        parser.error("--root and --batch-id go together")
    if args.measure:
        print(json.dumps(measure(args.measure, args.root, args.batch_id, args.repeat)))
        return 0

    with tempfile.TemporaryDirectory(prefix="bench-report-") as scratch:
        trees = [("this checkout", ROOT, "current")]
        if args.baseline:
            old = archive(args.baseline, Path(scratch, "baseline"))
            trees.insert(0, (f"baseline {args.baseline}", old, "baseline"))
        root, batch_id = args.root, args.batch_id
        if root is None:
            started = time.perf_counter()
            root = str(Path(scratch, "root"))
            batch_id = build(root, args.tasks, args.group_size, args.shards)
            seconds = time.perf_counter() - started
            print(f"built {args.tasks} × {args.group_size} rollouts in {args.shards} shards ({seconds:.1f}s)")
        results = {name: measure_in(tree, page, root, batch_id, args.repeat) for name, tree, page in trees}
    rows = next(iter(results.values()))
    width = max(map(len, rows))
    print(f"{'':{width}}" + "".join(f"  {name:>22}" for name in results))
    for key in rows:
        print(f"{key:{width}}" + "".join(f"  {_cell(result[key]):>22}" for result in results.values()))
    return 0


def _cell(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value * 1000:,.1f} ms"


if __name__ == "__main__":
    raise SystemExit(main())
