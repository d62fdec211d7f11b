"""The ``rollout_batch`` DAG: one batch of multi-turn rollouts, from plan to a published GRPO dataset.

Airflow parses this file; :func:`tasks.orchestration.rollout_dag.rollout_batch_dag` builds the DAG,
whose doc in the UI says what each task does.
"""

from tasks.orchestration.rollout_dag import rollout_batch_dag

rollout_batch = rollout_batch_dag()
