"""A planned rollout: one row of ``plan/shard-NNNNN.parquet`` (which task, which sample of its group, its seed)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from tasks.schema import ArrowRecord, column


@dataclass(frozen=True, eq=False)
class PlannedRollout(ArrowRecord):
    """One rollout of the plan: which task, which sample of its group, and its seed."""

    rollout_id: str = column(pa.string())
    group_id: str = column(pa.string())
    task_index: int = column(pa.int64())
    sample_index: int = column(pa.int32())
    seed: int = column(pa.int64())
    task_json: str = column(pa.string())
