"""rollout-ledger as an Airflow provider: the connection types it brings, with their forms.

Airflow's ProvidersManager calls :func:`get_provider_info` through the ``apache_airflow_provider``
entry point (pyproject.toml) in every component; the type then appears in the UI's connection
list with its form (``conn-fields`` and ``ui-field-behaviour``, Airflow 3.3's declarative form)
and a Test button (the hook's ``test_connection``). ``package-name`` must be this distribution's name.

Plain data, importing nothing: Airflow may read it while it is itself being imported, so the
hook (which imports Airflow) takes its names from here, never the other way round.
"""

from __future__ import annotations

from typing import Any

PACKAGE_NAME = "rollout-ledger"
SERVERS_CONN_TYPE = "rollout_servers"
SERVERS_HOOK = "tasks.orchestration.hooks.rollout_servers.RolloutServerHook"
SERVERS_HOOK_NAME = "rollout-ledger vLLM servers"
SERVERS_DEFAULT_CONN_ID = "rollout_servers"  # the hook's default connection
SERVERS_EXTRA_URLS = "urls"  # the extra field listing more replicas


def get_provider_info() -> dict[str, Any]:
    """The provider info Airflow validates against its ``provider_info.schema.json``."""
    return {
        "package-name": PACKAGE_NAME,
        "name": "rollout-ledger",
        "description": "Token-exact rollout capture: the connection type of the vLLM servers a batch calls.",
        "connection-types": [
            {
                "connection-type": SERVERS_CONN_TYPE,
                "hook-class-name": SERVERS_HOOK,
                "hook-name": SERVERS_HOOK_NAME,
                "ui-field-behaviour": {
                    "hidden-fields": ["login"],
                    "relabeling": {"host": "Server host or base URL", "schema": "Scheme", "password": "API key"},
                    "placeholders": {
                        "host": "10.0.0.5, or a base URL such as https://servers.example/v",
                        "port": "8000",
                        "schema": "http (default) or https",
                        "password": "the servers' API key (rollout-ledger serve --api-key-file)",
                    },
                },
                "conn-fields": {
                    SERVERS_EXTRA_URLS: {
                        "label": "More replicas",
                        "description": "Base URLs of more servers of the same model, one per line.",
                        "schema": {"type": ["array", "null"], "items": {"type": "string"}},
                    }
                },
            }
        ],
    }
