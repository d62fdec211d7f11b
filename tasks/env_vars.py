"""Environment variables set for a block: :func:`scoped_environ`.

A foundation module (standard library only), so any module may use it. On leaving the block,
by any path, every variable named is exactly as it was: a previous value comes back, and a
variable that was unset is removed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def scoped_environ(**values: str) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block, then restore every one of them as it was."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        os.environ.update(values)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
