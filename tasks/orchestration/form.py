"""The batch form: the Airflow trigger form's fields, derived from the batch fields' declaration.

The DAG factory (:mod:`tasks.orchestration.rollout_dag`) wraps each field of :func:`form_fields` in
a ``Param``, the periodic profiles (``dags/profiles.yaml``) check their values against it and
``make demo`` runs its defaults. Every field, its default, bounds, title, description and section is declared once in
:class:`tasks.batch_fields.BatchFields`; this module only shapes it for Airflow. No Airflow
import here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tasks.batch_fields import field_default, field_defaults, json_schemas
from tasks.trigger_policy import any_below, load_trigger_policy

DEFAULT_REVIEW_TIMEOUT_HOURS = field_default("review_timeout_hours")  # the review operator's, until a run sets its own


def form_fields(environ: Mapping[str, str] = os.environ) -> dict[str, dict[str, Any]]:
    """Field name -> ``default``, ``section``, ``title``, ``description`` and the JSON Schema keywords.

    ``storage_url``'s default follows ``environ`` (:func:`tasks.batch_fields.default_storage_url`);
    ``environment`` is a choice among what a trigger may run (:func:`environment_choices`), ``engine``
    among the registered engines (:func:`engine_choices`); the model, the connections, the storage URL
    and the engine options' keys are limited to what the trigger policy allows
    (:meth:`tasks.trigger_policy.TriggerPolicy.form_limits`).
    """
    policy = load_trigger_policy(environ)
    defaults = field_defaults(environ)
    fields = {name: {"default": defaults[name], **schema} for name, schema in json_schemas().items()}
    fields["environment"] = {**fields["environment"], **environment_choices(environ)}
    fields["engine"] = {**fields["engine"], **engine_choices()}
    for name, limits in policy.form_limits().items():
        fields[name] = {**fields[name], **limits}
    if not any_below(fields["storage_url"]["default"], policy.storage_urls):
        fields["storage_url"]["default"] = policy.storage_urls[0]  # the default must be a value the form allows
    return fields


def engine_choices() -> dict[str, Any]:
    """The engine field's ``enum`` and labels: the registered engines."""
    from tasks.engines.registry import engine_labels, engine_names

    return {"enum": list(engine_names()), "values_display": engine_labels()}


def environment_choices(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The environment field's ``enum`` and labels: the built-in games and the deployment registry's entries."""
    from tasks.environments.declared import registry_file
    from tasks.environments.registry import Runnables

    runnables = Runnables.triggered(registry_file(environ))
    registry = runnables.registry
    names = runnables.choices()
    labels = {
        name: f"{name}: {registry.entries[name].description}" if registry.entries[name].description else name
        for name in registry.entries
    }
    return {
        "enum": names,
        "description": f"a built-in game, or an environment the deployment declared in {registry.path.name}",
        "values_display": {name: labels.get(name, f"{name} (built-in)") for name in names},
    }


def form_defaults(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Every field's default value."""
    return field_defaults(environ)
