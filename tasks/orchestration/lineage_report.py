"""A task's datasets, reported to OpenLineage through the Airflow provider (docs/lineage.md).

The provider's listener emits every task's START and COMPLETE or FAIL; :func:`report_lineage`
adds a RUNNING event with the task's inputs and outputs and their facets, through the provider's
public ``emit_dataset_lineage``. Nothing is built when the provider is missing or has no
transport configured (the ``[openlineage]`` section). It never fails the task: an error building
the datasets is logged here; a transport error is logged by the provider and counted in its
``ol.emit.failed`` metric.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.lineage.datasets import TaskLineage

log = logging.getLogger("rollout_ledger.airflow")


def report_lineage(lineage: Callable[[], TaskLineage]) -> None:
    """Emit the current task's datasets, built by ``lineage`` only when OpenLineage is active."""
    try:
        from airflow.providers.openlineage.api import emit_dataset_lineage, is_openlineage_active
    except ImportError:
        log.debug("apache-airflow-providers-openlineage is not installed: no lineage reported")
        return
    if not is_openlineage_active():
        return
    try:
        found = lineage()
    except Exception as exc:
        log.warning("OpenLineage: could not describe this task's datasets: %s", exc, exc_info=True)
        return
    if found:
        emit_dataset_lineage(inputs=list(found.inputs), outputs=list(found.outputs))
