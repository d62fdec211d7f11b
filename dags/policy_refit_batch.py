"""The ``policy_refit_batch`` DAG: on each ``policy_checkpoint`` event, a verified refit and one rollout batch at it.

Airflow parses this file; :func:`tasks.orchestration.loop_dag.policy_refit_batch_dag` builds the DAG,
whose doc in the UI says what each task verifies (docs/loop.md).
"""

from tasks.orchestration.loop_dag import policy_refit_batch_dag

policy_refit_batch = policy_refit_batch_dag()
