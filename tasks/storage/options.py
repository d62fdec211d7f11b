"""fsspec storage options for a root URL: how credentials reach every stage (docs/architecture.md §12).

Stage functions take a root URL plus ``storage_options`` (a plain mapping handed to fsspec);
nothing about credentials is ever written into a batch. The CLI fills the options from the
standard AWS environment variables (:func:`storage_options_from_env`), or all at once from
``ROLLOUT_LEDGER_STORAGE_OPTIONS`` (a JSON object: how an Airflow task hands a connection's
options to the process it starts); the Airflow DAG from a connection. Error messages and logs
name which variables were read, never their values.

One option is rollout-ledger's own and never reaches fsspec: :data:`RETRY_OPTION`, the retry
policy of every storage operation (:class:`tasks.storage.retries.RetryPolicy`). Without it, a
store takes the policy from ``$ROLLOUT_LEDGER_STORAGE_RETRY`` (the same JSON object), else the
defaults: :func:`retry_settings`. That policy is the only retry loop: an S3 filesystem a store
builds asks botocore for one attempt per call and a short connect timeout
(:data:`S3_CONFIG_DEFAULTS`), under whatever ``config_kwargs`` the options set themselves
(:func:`with_s3_defaults`), so a dead endpoint fails within the policy's deadline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

StorageOptions = Mapping[str, Any]
# AWS variable -> s3fs option. Region goes through botocore's client arguments.
AWS_VARIABLES = {
    "AWS_ACCESS_KEY_ID": "key",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "AWS_SESSION_TOKEN": "token",
    "AWS_ENDPOINT_URL": "endpoint_url",
    "AWS_ENDPOINT_URL_S3": "endpoint_url",
}
AWS_REGION_VARIABLES = ("AWS_REGION", "AWS_DEFAULT_REGION")
STORAGE_OPTIONS_VARIABLE = "ROLLOUT_LEDGER_STORAGE_OPTIONS"
# {"attempts": 6, "deadline_s": 60, "initial_wait_s": 0.2, "max_wait_s": 10}: any subset of RetryPolicy's fields.
RETRY_OPTION = "rollout_ledger_retry"
RETRY_VARIABLE = "ROLLOUT_LEDGER_STORAGE_RETRY"
# botocore Config of every S3 filesystem a store builds, for the keys the options' config_kwargs leave out.
S3_CONFIG_DEFAULTS: Mapping[str, Any] = {"retries": {"total_max_attempts": 1}, "connect_timeout": 3}


def is_s3_url(url: str) -> bool:
    return url.startswith(("s3://", "s3a://"))


def storage_options_from_env(url: str, environ: Mapping[str, str]) -> dict[str, Any]:
    """fsspec options for ``url``: ``$ROLLOUT_LEDGER_STORAGE_OPTIONS`` when set, else s3fs options from the
    AWS variables set in ``environ`` (``{}`` for other schemes).

    ``AWS_ENDPOINT_URL_S3`` wins over ``AWS_ENDPOINT_URL`` (botocore's own precedence).
    """
    if environ.get(STORAGE_OPTIONS_VARIABLE):
        return _json_object(environ[STORAGE_OPTIONS_VARIABLE], STORAGE_OPTIONS_VARIABLE, "fsspec options")
    if not is_s3_url(url):
        return {}
    options: dict[str, Any] = {}
    for variable, option in AWS_VARIABLES.items():
        if environ.get(variable):
            options[option] = environ[variable]
    region = next((environ[v] for v in AWS_REGION_VARIABLES if environ.get(v)), None)
    if region:
        options["client_kwargs"] = {"region_name": region}
    return options


def with_s3_defaults(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with :data:`S3_CONFIG_DEFAULTS` added to its ``config_kwargs`` for each key it does not set."""
    from tasks.errors import ConfigError

    own = options.get("config_kwargs") or {}
    if not isinstance(own, Mapping):
        raise ConfigError(f"storage option config_kwargs must be a mapping of botocore Config arguments, got {own!r}")
    return {**options, "config_kwargs": {**S3_CONFIG_DEFAULTS, **own}}


def aws_variables_read(environ: Mapping[str, str]) -> list[str]:
    """Names (never values) of the storage variables that are set: what an S3 error message cites."""
    return [v for v in (STORAGE_OPTIONS_VARIABLE, *AWS_VARIABLES, *AWS_REGION_VARIABLES) if environ.get(v)]


def retry_settings(option: Any, environ: Mapping[str, str]) -> Any:
    """A store's retry settings: the :data:`RETRY_OPTION` value when given, else ``$ROLLOUT_LEDGER_STORAGE_RETRY``
    parsed, else None (the defaults)."""
    if option is not None or not environ.get(RETRY_VARIABLE):
        return option
    return _json_object(environ[RETRY_VARIABLE], RETRY_VARIABLE, "storage retry settings")


def _json_object(text: str, variable: str, what: str) -> dict[str, Any]:
    from tasks.errors import ConfigError
    from tasks.strict_json import parse_json

    options = parse_json(text, source=f"${variable}", error=ConfigError)
    if not isinstance(options, dict):
        raise ConfigError(f"${variable} must be a JSON object of {what}")
    return options
