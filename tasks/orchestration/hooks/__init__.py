"""Airflow hooks: one per external system a DAG run reaches (connection parsing, its test, its secrets masked)."""
