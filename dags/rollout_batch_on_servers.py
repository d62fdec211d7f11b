"""The ``rollout_batch_on_servers`` DAG: ``rollout_batch`` calling running vLLM servers, so generate needs no GPU.

Airflow parses this file; :func:`tasks.orchestration.rollout_dag.servers_dag` builds the DAG. Its
form names the servers by the Airflow connection ``rollout_servers`` (docs/servers.md).
"""

from tasks.orchestration.rollout_dag import servers_dag

rollout_batch_on_servers = servers_dag()
