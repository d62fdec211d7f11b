"""Periodic batch profiles: a YAML file where each profile is a cron schedule plus batch form values.

``dags/rollout_profiles.py`` builds one scheduled ``rollout_batch`` DAG per profile (DAG id
``rollout_batch__<name>``), so adding a periodic batch takes no Python. Every field is checked
here, against the same form schema the trigger form uses; a bad field raises
:class:`ProfileError` naming the file, the profile and the field, which Airflow shows as the
profiles file's import error (the manual ``rollout_batch`` DAG lives in its own file and keeps
working). File format::

    profiles:
      nightly_arithmetic:            # [a-z0-9_]+
        schedule: "0 3 * * *"        # cron (required)
        timezone: UTC                # default UTC
        paused: true                 # paused when first created; default true
        description: ...             # optional
        params: {num_tasks: 64, ...} # batch form fields (defaults for every run); not batch_id
"""

from __future__ import annotations

import re
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.errors import ProfileError, TriggerPolicyError
from tasks.orchestration.form import form_fields
from tasks.trigger_policy import load_trigger_policy

PROFILE_NAME = re.compile(r"[a-z0-9_]+")
PROFILE_KEYS = {"schedule", "timezone", "paused", "description", "params"}
DAG_ID_PREFIX = "rollout_batch__"


@dataclass(frozen=True)
class Profile:
    name: str
    cron: str
    timezone: str = "UTC"
    paused: bool = True
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def dag_id(self) -> str:
        return f"{DAG_ID_PREFIX}{self.name}"


def load_profiles(path: str | Path) -> list[Profile]:
    """Every profile of the YAML file at ``path`` (an absent file has none), each field checked."""
    import yaml

    path = Path(path)
    if not path.exists():
        return []
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from None
    if document is None:
        return []
    if not isinstance(document, dict) or set(document) != {"profiles"} or not isinstance(document["profiles"], dict):
        raise ProfileError(f"{path}: expected a single top-level mapping 'profiles: {{name: profile, ...}}'")
    return [_profile(f"{path}: profile {name!r}", name, raw) for name, raw in document["profiles"].items()]


def _profile(where: str, name: Any, raw: Any) -> Profile:
    if not isinstance(name, str) or not PROFILE_NAME.fullmatch(name):
        raise ProfileError(f"{where}: a profile name uses [a-z0-9_] only")
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: expected a mapping with {sorted(PROFILE_KEYS)}")
    unknown = sorted(set(raw) - PROFILE_KEYS)
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {unknown}; known: {sorted(PROFILE_KEYS)}")
    cron = raw.get("schedule")
    if not isinstance(cron, str) or not _is_cron(cron):
        raise ProfileError(f"{where}: schedule {cron!r} is not a cron expression like '0 3 * * *'")
    timezone = raw.get("timezone", "UTC")
    if not isinstance(timezone, str) or not _is_timezone(timezone):
        raise ProfileError(f"{where}: timezone {timezone!r} is not an IANA time zone like 'UTC' or 'Europe/Paris'")
    paused = raw.get("paused", True)
    if not isinstance(paused, bool):
        raise ProfileError(f"{where}: paused must be true or false, got {paused!r}")
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise ProfileError(f"{where}: description must be text")
    params = raw.get("params") or {}
    if not isinstance(params, dict):
        raise ProfileError(f"{where}: params must be a mapping of batch form fields")
    return Profile(name, cron, timezone, paused, description, check_params(where, params))


def check_params(where: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` when every name is a batch form field, every value fits that field's JSON Schema, and the trigger
    policy allows them (a profile's runs are triggered runs: tasks/trigger_policy.py)."""
    import jsonschema

    fields = form_fields()
    for name, value in params.items():
        if name == "batch_id":
            raise ProfileError(f"{where}: params.batch_id cannot be set: each scheduled run derives its own")
        if name not in fields:
            raise ProfileError(f"{where}: params.{name} is not a batch form field; known: {sorted(fields)}")
        schema = {k: v for k, v in fields[name].items() if k not in ("default", "section", "values_display")}
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as exc:
            raise ProfileError(f"{where}: params.{name}: {exc.message}") from None
    policy = load_trigger_policy()
    try:
        policy.check_values(params)
        if "storage_url" in params or "storage_conn_id" in params:
            url = params.get("storage_url", fields["storage_url"]["default"])
            policy.check_storage(url, params.get("storage_conn_id"))
    except TriggerPolicyError as exc:
        raise ProfileError(f"{where}: params: {exc}") from None
    return dict(params)


def _is_cron(expression: str) -> bool:
    from croniter import croniter

    return len(expression.split()) == 5 and croniter.is_valid(expression)


def _is_timezone(name: str) -> bool:
    try:
        zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        return False
    return True
