"""Where a run's batch lives, as its ``plan`` task records it in XCom for the report viewer.

The record (``batch_id``, ``storage_url``, ``storage_conn_id``; never credentials) is written by
:func:`tasks.orchestration.steps.batch_record` and read by the viewer under these two names.
"""

PLAN_TASK_ID = "plan"
BATCH_XCOM_KEY = "batch"
