"""An external trainer's side of the loop: announce a checkpoint through Airflow's REST API (docs/loop.md).

A trainer that runs outside Airflow posts the ``policy_checkpoint`` event itself, with the same
extra ``grpo_train`` emits (:meth:`tasks.orchestration.loop.CheckpointEvent.to_extra`):
``POST /api/v2/assets/events`` with ``{"asset_id": ..., "extra": {...}}``, authenticated with a
bearer token (the simple auth manager's ``POST /auth/token``; another auth manager issues its
own). Airflow adds ``"from_rest_api": true`` to the extra. The event is checked like any other by
``policy_refit_batch``: the folder must be below the deployment's checkpoints root and hash as
announced, whoever posted it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.orchestration.loop import POLICY_CHECKPOINT_ASSET


class AirflowApi:
    """Airflow's public REST API (``/api/v2``) with a bearer token."""

    def __init__(self, url: str, token: str, *, timeout: float = 30.0) -> None:
        import httpx

        self.client = httpx.Client(
            base_url=url.rstrip("/"), timeout=timeout, headers={"Authorization": f"Bearer {token}"}
        )

    @classmethod
    def login(cls, url: str, username: str, password: str) -> AirflowApi:
        """A token from the simple auth manager's ``POST /auth/token`` (the local Airflow's login)."""
        import httpx

        response = httpx.post(
            f"{url.rstrip('/')}/auth/token", json={"username": username, "password": password}, timeout=30
        )
        response.raise_for_status()
        return cls(url, response.json()["access_token"])

    def asset_id(self, name: str) -> int | None:
        """The id of the asset called ``name`` (``None`` until a parsed DAG names it)."""
        response = self.client.get("/api/v2/assets", params={"name_pattern": name, "limit": 100})
        response.raise_for_status()
        ids = [asset["id"] for asset in response.json()["assets"] if asset["name"] == name]
        return ids[0] if ids else None

    def post_asset_event(self, name: str, extra: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /api/v2/assets/events`` for the asset ``name``: the event as Airflow recorded it."""
        asset = self.asset_id(name)
        if asset is None:
            raise LookupError(f"Airflow knows no asset {name!r}: is the DAG scheduled on it parsed?")
        response = self.client.post("/api/v2/assets/events", json={"asset_id": asset, "extra": dict(extra)})
        response.raise_for_status()
        return response.json()

    def unpause(self, dag_id: str) -> None:
        response = self.client.patch(f"/api/v2/dags/{dag_id}", json={"is_paused": False})
        response.raise_for_status()

    def close(self) -> None:
        self.client.close()


def announce_checkpoint(api: AirflowApi, extra: Mapping[str, Any]) -> dict[str, Any]:
    """Post the ``policy_checkpoint`` event of a checkpoint (its extra is checked here first, as the DAG will)."""
    from tasks.orchestration.loop import CheckpointEvent

    return api.post_asset_event(POLICY_CHECKPOINT_ASSET, CheckpointEvent.from_extra(extra).to_extra())
