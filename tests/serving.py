"""Running ``rollout-ledger serve`` in a test as a process manager would."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil


@contextlib.contextmanager
def serve_process(argv: list[str], home: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """``rollout-ledger serve`` (``argv``) run as a process manager runs it: yields the URL it prints (its stderr in
    ``home/serve.stderr``); then SIGTERM, and it must exit 0 leaving none of the processes it started."""

    with (home / "serve.stderr").open("w") as stderr:
        serve = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        url = serve.stdout.readline().strip() if serve.stdout else ""
        assert url.startswith("http://127.0.0.1:"), f"serve printed no URL:\n{(home / 'serve.stderr').read_text()}"
        started = psutil.Process(serve.pid).children(recursive=True)
        yield url
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=120)
    assert code == 0, f"serve exited {code} on SIGTERM:\n{(home / 'serve.stderr').read_text()[-3000:]}"
    left = [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert started and not left, f"processes of rollout-ledger serve outlived its SIGTERM: {left}"
