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
import os
import socket
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.test_load import GROUP_SIZE, NUM_TASKS, SHARDS, check_load, figures_line, load_config, run_load


def _moto_bucket() -> str:
    """Start moto's S3 server on loopback, point the AWS environment at it, make a bucket; its s3:// URL."""
    import s3fs
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ThreadedMotoServer(ip_address="127.0.0.1", port=port).start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    name = f"bench-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True).mkdir(name)
    return f"s3://{name}"


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
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        root = f"{_moto_bucket()}/runs" if args.s3 else str(Path(tmp) / "runs")
        figures = run_load(root, tokenizer, config, publish=not args.no_publish)
    check_load(figures)
    print(figures_line(figures))


if __name__ == "__main__":
    main()
