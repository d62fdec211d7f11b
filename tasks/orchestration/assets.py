"""The Airflow assets of the training loop (docs/loop.md): ``grpo_dataset`` and ``policy_checkpoint``.

``grpo_dataset`` is defined with the batch DAG that updates it (``publish``,
:data:`tasks.orchestration.rollout_dag.GRPO_DATASET`); it is re-exported here so that the loop's
DAGs name both assets from one module. ``policy_checkpoint`` is defined here, once: ``grpo_train``
updates it, ``policy_refit_batch`` is scheduled on it, and an external trainer may post its events
through Airflow's REST API (``POST /api/v2/assets/events``). Its events' extra is
:meth:`tasks.orchestration.loop.CheckpointEvent.to_extra`: ``weight_version``, ``weights_sha256``,
``step``, ``folder`` and ``parent``.
"""

from __future__ import annotations

from airflow.sdk import Asset

from tasks.orchestration.loop import POLICY_CHECKPOINT_ASSET
from tasks.orchestration.rollout_dag import GRPO_DATASET

POLICY_CHECKPOINT = Asset(POLICY_CHECKPOINT_ASSET)

__all__ = ["GRPO_DATASET", "POLICY_CHECKPOINT"]
