"""A moto S3 server on loopback for the bench scripts that run on S3, and a fresh bucket on it.

The server runs in a subprocess (its CPU apart from the bench's, as a remote S3 is) or, with
``in_process=True``, in a thread of this process (so RSS figures include moto's in-memory objects).
Either way the AWS environment of this process is pointed at it, with moto's test credentials.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

START_TIMEOUT_SECONDS = 60.0


@contextlib.contextmanager
def _server_process(port: int) -> Iterator[None]:
    """``python -m moto.server`` on ``port``, once it accepts connections; terminated on exit."""
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto server did not start (exit code {server.poll()})")
            time.sleep(0.1)
        yield
    finally:
        server.terminate()
        server.wait(timeout=30)


@contextlib.contextmanager
def _server_thread(port: int) -> Iterator[None]:
    """moto's ``ThreadedMotoServer`` on ``port`` (its ``start`` returns once it serves); stopped on exit."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield
    finally:
        server.stop()


@contextlib.contextmanager
def moto_s3(*, in_process: bool = False) -> Iterator[str]:
    """A moto S3 server on loopback, the AWS environment pointed at it; yields a new bucket's ``s3://`` URL."""
    import s3fs

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with (_server_thread if in_process else _server_process)(port):
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
        )
        name = f"bench-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True).mkdir(name)
        yield f"s3://{name}"
