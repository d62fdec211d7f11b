"""OpenLineage lineage of a batch: dataset names, facets, what each task reads and writes, and emission.

See docs/lineage.md. :mod:`~tasks.lineage.datasets` says what each task of ``rollout_batch`` reads
and writes; :mod:`~tasks.lineage.emit` sends it as OpenLineage events where Airflow's provider
does not (the CLI).
"""
