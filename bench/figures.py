"""Figures as the benchmark scripts print them: ratios, percentiles in ms, and plain-text tables.

Imported by the bench scripts (``from bench.figures import ...``, with the repository root on
``sys.path``), so every table they print is laid out and rounded the same way. Named apart from
PyTables' ``tables``: a script's own folder comes first on ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ratio(a: float, b: float) -> str:
    """``a / b`` to two decimals; ``-`` where ``b`` is 0."""
    return f"{a / b:.2f}" if b else "-"


def percentile_ms(seconds: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``seconds``, in milliseconds."""
    return float(np.percentile(np.asarray(seconds), q)) * 1000.0


def print_table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    """``header`` and ``rows`` in left-aligned columns two spaces apart, each as wide as its widest cell."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
