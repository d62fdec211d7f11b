"""Keeping a process's memory from other processes of the same user: the processes that hold secrets call this.

Standard library only (a foundation module): the generate worker and ``rollout-ledger generate`` hold
storage credentials and the servers' key, and run agents.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_DUMPABLE = 4


def make_undumpable() -> bool:
    """Make this process non-dumpable where the platform allows it (Linux: ``PR_SET_DUMPABLE`` 0): a process of
    the same user can then read neither its memory nor its ``/proc/PID/environ``, nor attach to it (root still
    can). Whether it took is returned; a new program this process execs is dumpable again."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
