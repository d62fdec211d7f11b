"""Load benchmark: one batch on the FAKE engine through plan, generate, finalize, validate and publish.

Runs :func:`tests.reliability.test_load.run_load` (the code the load test runs) on local disk in
a temp dir, or with ``--s3`` on a moto S3 server started in this process (so the RSS figures then
include moto's in-memory objects), checks it like the test does, and prints the figures as one
JSON line: rollouts, calls, tokens, seconds per stage, RSS at the start, peak RSS and growth.
The engine is the tests' FAKE (``FakeScriptedEngine``): no inference, instant scripted replies
tokenized by the real bundled tokenizer.

    python bench/load.py [--tasks 1000] [--group-size 2] [--shards 4] [--s3] [--no-publish]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moto_s3 import moto_s3
from tests.reliability.test_load import GROUP_SIZE, NUM_TASKS, SHARDS, check_load, figures_line, load_config, run_load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=NUM_TASKS)
    parser.add_argument("--group-size", type=int, default=GROUP_SIZE)
    parser.add_argument("--shards", type=int, default=SHARDS)
    parser.add_argument("--s3", action="store_true", help="run on a moto S3 server started in this process")
    parser.add_argument("--no-publish", action="store_true", help="finalize only (no validation suites, no publish)")
    args = parser.parse_args()
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    from tasks.models.bundled import load_bundled_tokenizer

    tokenizer = load_bundled_tokenizer()
    config = load_config(args.tasks, args.group_size, args.shards)
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp, contextlib.ExitStack() as stack:
        root = f"{stack.enter_context(moto_s3(in_process=True))}/runs" if args.s3 else str(Path(tmp) / "runs")
        figures = run_load(root, tokenizer, config, publish=not args.no_publish)
    check_load(figures)
    print(figures_line(figures))


if __name__ == "__main__":
    main()
