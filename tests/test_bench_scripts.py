"""The benchmark scripts still run end to end and print every figure they promise.

Smoke runs at toy sizes, as a user runs them (a subprocess from the repository root). The
targets themselves are judged at full size by running the scripts, never here: at these sizes
fixed costs dominate, so only the exit status (0 all targets pass, 1 some fail) and the printed
metrics are checked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run_bench(script: str, *args: str, tmp_path: Path) -> str:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode in (0, 1), f"{script} crashed:\n{completed.stdout}\n{completed.stderr}"
    assert "Traceback" not in completed.stderr, completed.stderr
    return completed.stdout


def test_staging_bench_prints_every_metric_per_workload(tmp_path: Path) -> None:
    out = run_bench("staging.py", "--rollouts", "20", "--turns", "2", "4", tmp_path=tmp_path)
    for workload in ("2 turns", "4 turns"):
        for metric in ("bytes/token", "full/delta bytes", "stage/raw tput", "writer-only/raw tput", "hashing share"):
            assert any(line.startswith(workload) and metric in line for line in out.splitlines()), (workload, metric)


def test_finalize_bench_prints_ratio_and_peak_memory(tmp_path: Path) -> None:
    out = run_bench("finalize.py", "--tokens", "2e5", "--shards", "2", tmp_path=tmp_path)
    assert "finalize / raw scan = " in out
    assert "finalize peak RSS   = " in out
    assert "dataset rows 100 (100 trainable)" in out


def test_admission_bench_prints_late_to_early_turn_ratio(tmp_path: Path) -> None:
    out = run_bench("admission.py", "--rollouts", "2", "--turns", "6", tmp_path=tmp_path)
    assert "turn 6 / turn 4 = " in out
    assert "checked against the full-render definition" in out


def test_shard_memory_bench_prints_peak_rss_ratio_and_tracemalloc_lines(tmp_path: Path) -> None:
    out = run_bench(
        "shard_memory.py",
        "--rollouts-small",
        "8",
        "--rollouts-large",
        "16",
        "--turns",
        "2",
        "--tracemalloc",
        tmp_path=tmp_path,
    )
    assert "FAKE engine" in out
    for shard, rollouts, calls in (("small", 8, 16), ("large", 16, 32)):
        line = next(line for line in out.splitlines() if line.startswith(f"{shard} shard: "))
        assert f"{rollouts} rollouts ({rollouts} ok), {calls} calls" in line, line
        assert "peak" in line and "RSS before" in line, line
    assert "peak RSS large / small = " in out
    assert "still alive just before the ledger commit" in out
