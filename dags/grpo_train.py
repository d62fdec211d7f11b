"""The ``grpo_train`` DAG: on each ``grpo_dataset`` event, one training step and the next ``policy_checkpoint``.

Airflow parses this file; :func:`tasks.orchestration.loop_dag.grpo_train_dag` builds the DAG, whose doc
in the UI says when the loop stops (``max_steps``, the deployment's; docs/loop.md).
"""

from tasks.orchestration.loop_dag import grpo_train_dag

grpo_train = grpo_train_dag()
