"""The trigger policy: what a person who triggers a batch may set, declared once (docs/security.md, door 1).

A trigger (the Airflow form, a run conf, the REST API, a profile's params) is not trusted: it
picks among what the deployment declared and sets values within bounds, never code, paths of the
worker's machine, server URLs or keys. This module is the one declaration of it:

* :data:`TRIGGER_FIELDS`: every batch field a trigger may set, with what limits it beyond the
  field's own declaration (:mod:`tasks.batch_fields`);
* :data:`ENGINE_OPTIONS`: within ``engine_options``, the keys a trigger may set for each engine,
  and their bounds. Never ``engine_kwargs`` or ``inference_kwargs`` (they can import or run
  code), server ``urls`` or ``api_key_file`` (they come from a ``rollout_servers`` connection);
* the deployment's lists, in its policy file (``dags/trigger_policy.yaml``, or the file
  ``$ROLLOUT_LEDGER_TRIGGER_POLICY`` names): the storage URLs a batch may live under, the storage
  and server connections a run may name, the models besides the bundled one.

The Airflow plan step applies :meth:`TriggerPolicy.check_values` to a run's values before
anything is read or sent; every step applies :meth:`TriggerPolicy.check_storage` before it
touches storage; the generate worker applies :meth:`TriggerPolicy.check_config` again to the
batch config it reads from storage, which is not trusted; the form offers only what the policy
allows (:meth:`TriggerPolicy.form_limits`). The ``rollout-ledger`` CLI belongs to an operator on
their own machine and is not bound by it.
"""

from __future__ import annotations

import functools
import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.batch_fields import BUNDLED_LABEL, MAX_SEED, default_storage_url, field_default
from tasks.engines.options import MAX_MASK_CANDIDATES
from tasks.environments.declared import TriggerOption
from tasks.errors import TriggerPolicyError
from tasks.models.reference import BUNDLED_REFERENCE

POLICY_VARIABLE = "ROLLOUT_LEDGER_TRIGGER_POLICY"
POLICY_FILE_NAME = "trigger_policy.yaml"
SERVER_ENGINE = "vllm_server"
FREE = "any value the field accepts"

# Every batch field a trigger may set, and what limits it besides the field's own type and bounds.
TRIGGER_FIELDS: Mapping[str, str] = {
    "batch_id": FREE,
    "num_tasks": FREE,
    "group_size": FREE,
    "shards": FREE,
    "max_turns": FREE,
    "max_in_flight": FREE,
    "resume": FREE,
    "seed": FREE,
    "environment": "a built-in game or an entry of the deployment's environment registry",
    "environment_options": "the options the registry entry opens to triggers (its trigger_options)",
    "message_graph": FREE,
    "model": "the bundled model, or a model the policy's models list names",
    "engine": "a registered engine",
    "engine_options": "the keys ENGINE_OPTIONS opens for the engine, within their bounds",
    "engine_conn_id": "a servers connection the policy lists (the servers' URLs and key come from it)",
    "weight_version": FREE,
    "temperature": FREE,
    "top_p": FREE,
    "top_k": FREE,
    "max_tokens": FREE,
    "on_invalid": FREE,
    "advantage": FREE,
    "storage_url": "at or below a storage URL the policy lists",
    "storage_conn_id": "a storage connection the policy lists",
    "max_invalid_row_rate": FREE,
    "max_capture_poisoned_rate": FREE,
    "max_poisoned_rate": FREE,
    "max_failure_row_rate": FREE,
    "min_declared_terminal_rate": FREE,
    "max_group_advantage_mean": FREE,
    "reward_min": FREE,
    "reward_max": FREE,
    "off_policy_max_ratio_deviation": FREE,
    "off_policy_ratio_bound": FREE,
    "off_policy_max_outside_rate": FREE,
    "off_policy_max_staleness": FREE,
    "require_review": FREE,
    "review_timeout_hours": FREE,
}
_POSITIVE_COUNT = TriggerOption(type="integer", minimum=1, maximum=1024)
_CONTEXT = TriggerOption(type="integer", minimum=2, maximum=1_048_576)
_SEED = TriggerOption(type="integer", minimum=0, maximum=MAX_SEED)
_MASK_CANDIDATES = TriggerOption(type="integer", minimum=2, maximum=MAX_MASK_CANDIDATES)
# Within engine_options: per engine, the keys a trigger may set (None leaves one unset) and their bounds.
ENGINE_OPTIONS: Mapping[str, Mapping[str, TriggerOption]] = {
    "vllm": {
        "dtype": TriggerOption(type="string", enum=["auto", "float32", "float16", "bfloat16"]),
        "max_model_len": _CONTEXT,
        "tensor_parallel_size": _POSITIVE_COUNT,
        "data_parallel_size": _POSITIVE_COUNT,
        "enforce_eager": TriggerOption(type="boolean"),
        "gpu_memory_utilization": TriggerOption(type="number", minimum=0.01, maximum=1),
        "seed": _SEED,
        "sampling_mask_candidates": _MASK_CANDIDATES,
    },
    SERVER_ENGINE: {
        "max_model_len": _CONTEXT,
        "request_timeout_s": TriggerOption(type="number", minimum=1, maximum=7 * 24 * 3600),
        "served_model": TriggerOption(type="string", max_length=256),
        "sampling_mask_candidates": TriggerOption(type="integer", minimum=0, maximum=MAX_MASK_CANDIDATES),
    },
    "megatron": {
        "dtype": TriggerOption(type="string", enum=["bfloat16", "float32"]),
        "max_model_len": _CONTEXT,
        "max_requests": TriggerOption(type="integer", minimum=1, maximum=65536),
        "kv_cache_gb": TriggerOption(type="number", minimum=0.01, maximum=4096),
        "seed": _SEED,
    },
}
FROM_CONNECTION = "urls"  # the server engine's option the run's servers connection fills in


class _Listed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _StorageLists(_Listed):
    urls: list[str] = Field(default_factory=list)
    connections: list[str] = Field(default_factory=list)


class _ServerLists(_Listed):
    connections: list[str] = Field(default_factory=list)


class _PolicyFile(_Listed):
    storage: _StorageLists = Field(default_factory=_StorageLists)
    servers: _ServerLists = Field(default_factory=_ServerLists)
    models: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class TriggerPolicy:
    """The deployment's lists, with the rules of :data:`TRIGGER_FIELDS` and :data:`ENGINE_OPTIONS` over them.

    ``storage_urls`` empty: only the form's default storage URL. Nothing else is allowed unless listed.
    """

    source: str  # the policy file, or a sentence saying there is none (for messages)
    storage_urls: tuple[str, ...]
    storage_connections: tuple[str, ...] = ()
    server_connections: tuple[str, ...] = ()
    models: tuple[str, ...] = field(default_factory=tuple)

    def refuse(self, what: str, why: str) -> TriggerPolicyError:
        return TriggerPolicyError(f"{what}: {why} (trigger policy: {self.source}; docs/security.md)")

    def check_values(self, values: Mapping[str, Any]) -> None:
        """Refuse values a trigger may not set; :class:`TriggerPolicyError` names the field and the rule.

        ``values`` are the run's (form, conf, profile): absent fields take their defaults. Storage is
        checked by :meth:`check_storage`; environment options by the registry.
        """
        if unknown := sorted(set(values) - set(TRIGGER_FIELDS)):
            raise self.refuse(f"run conf field(s) {unknown}", f"a trigger may set only {sorted(TRIGGER_FIELDS)}")
        model = values.get("model", field_default("model"))
        if not self.allows_model(model):
            allowed = [BUNDLED_REFERENCE, *self.models]
            raise self.refuse(f"model {model!r}", f"a trigger picks one of {allowed}; a deployment lists others")
        engine = values.get("engine", field_default("engine"))
        self.check_engine_options(engine, values.get("engine_options") or {})
        conn_id = values.get("engine_conn_id")
        if conn_id is not None and conn_id not in self.server_connections:
            raise self.refuse(
                f"engine_conn_id {conn_id!r}",
                f"not a servers connection the deployment lists: {self.server_connections}",
            )
        if engine == SERVER_ENGINE and conn_id is None:
            raise self.refuse(
                f"engine {SERVER_ENGINE}",
                f"a triggered batch names its servers by engine_conn_id, one of {list(self.server_connections)}",
            )

    def allows_model(self, model: str) -> bool:
        """Whether ``model`` (a reference, a path or a ``file://`` URI of the same folder) is the bundled one or one
        the policy lists."""
        from tasks.models.reference import model_reference

        def folder(reference: str) -> str:
            return model_reference(reference).removeprefix("file://")

        try:
            return folder(model) in {folder(allowed) for allowed in (BUNDLED_REFERENCE, *self.models)}
        except ValueError:
            return False

    def check_engine_options(self, engine: str, options: Mapping[str, Any]) -> None:
        """Refuse an engine option a trigger may not set, or a value outside its bounds."""
        opened = ENGINE_OPTIONS.get(engine, {})
        for key, value in options.items():
            if key not in opened:
                why = (
                    "the servers and their key come from the run's servers connection, engine_conn_id"
                    if engine == SERVER_ENGINE and key in (FROM_CONNECTION, "api_key_file")
                    else "the deployment sets it"
                )
                raise self.refuse(
                    f"engine_options.{key}", f"a trigger may not set it ({why}); it may set {sorted(opened) or 'none'}"
                )
            if value is not None:
                try:
                    opened[key].check(f"engine_options.{key}", value)
                except ValueError as error:
                    raise self.refuse(f"engine_options.{key}", str(error)) from None

    def check_storage(self, url: str, conn_id: str | None) -> None:
        """Refuse storage outside the listed URLs, or a connection (``conn_id``, or one in the URL) not listed."""
        parts = urlsplit(url)
        in_url = parts.username if parts.scheme in ("s3", "s3a") else None
        for named in (conn_id, in_url):
            if named is not None and named not in self.storage_connections:
                raise self.refuse(
                    f"storage connection {named!r}", f"not one the deployment lists: {list(self.storage_connections)}"
                )
        if not any_below(url, self.storage_urls):
            raise self.refuse(
                f"storage_url {_without_userinfo(url)!r}",
                f"a batch lives at or below one of {list(self.storage_urls)}",
            )

    def check_config(self, config: Any, *, server_urls: Sequence[str] | None) -> None:
        """Refuse a batch config (read from storage: untrusted) that a triggered run could not have planned.

        ``server_urls``: the URLs of the run's servers connection (the only ones its key may go to);
        a config naming other servers is refused. The environment is the registry's to check.
        """
        if not self.allows_model(config.model.reference):
            raise self.refuse(f"the batch config's model {config.model.reference!r}", "not a model the policy allows")
        options = dict(config.engine.options)
        urls = options.pop(FROM_CONNECTION, None) if config.engine.name == SERVER_ENGINE else None
        self.check_engine_options(config.engine.name, options)
        if urls is not None and list(urls) != list(server_urls or ()):
            raise self.refuse(
                f"the batch config's servers {urls}",
                f"not the run's servers connection's {list(server_urls or ())}: the key goes to those only",
            )

    def form_limits(self) -> dict[str, dict[str, Any]]:
        """JSON Schema keywords that limit the form's fields to what the policy allows (Airflow checks them at
        trigger time): the model, connection and storage choices, and the engine options' keys."""
        keys = sorted({key for opened in ENGINE_OPTIONS.values() for key in opened})
        models = {BUNDLED_REFERENCE: BUNDLED_LABEL, **{model: model for model in self.models}}
        return {
            "model": {"enum": list(models), "values_display": models},
            "engine_conn_id": _connection_choice(self.server_connections),
            "storage_conn_id": _connection_choice(self.storage_connections),
            "storage_url": {"pattern": storage_pattern(self.storage_urls)},
            "engine_options": {"propertyNames": {"enum": keys}},
        }


def _connection_choice(names: Sequence[str]) -> dict[str, Any]:
    """A form field choosing none or one of the connections ``names`` (``null`` shows as the empty choice)."""
    return {"enum": [None, *names], "values_display": {name: name for name in names}}


def _normalized(url: str) -> tuple[str, str, str]:
    """(scheme, bucket or host, normalized path) of a storage URL; a local path is a ``file`` URL."""
    parts = urlsplit(url)
    scheme = (parts.scheme or "file").lower()
    if scheme in ("file", "local"):
        return "file", "", posixpath.normpath(os.path.abspath(parts.path or "/"))
    return scheme, (parts.hostname or "").lower(), posixpath.normpath("/" + parts.path.lstrip("/"))


def _below(url: str, allowed: str) -> bool:
    """Whether ``url`` is ``allowed`` or below it (segment by segment: ``/a/bc`` is not below ``/a/b``)."""
    if ".." in urlsplit(url).path.split("/"):
        return False
    scheme, host, path = _normalized(url)
    allowed_scheme, allowed_host, allowed_path = _normalized(allowed)
    inside = path == allowed_path or path.startswith(allowed_path.rstrip("/") + "/")
    return (scheme, host) == (allowed_scheme, allowed_host) and inside


def any_below(url: str, allowed: Sequence[str]) -> bool:
    """Whether ``url`` is at or below one of the ``allowed`` storage URLs."""
    return any(_below(url, prefix) for prefix in allowed)


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl() if "@" in parts.netloc else url


def storage_pattern(urls: Sequence[str]) -> str:
    """A regular expression for the form: a URL that starts with one of ``urls`` (the plan step checks segments)."""
    import re

    return "^(" + "|".join(re.escape(url.rstrip("/")) for url in urls) + ")(/.*)?$"


def policy_file(environ: Mapping[str, str] = os.environ) -> Path:
    """``$ROLLOUT_LEDGER_TRIGGER_POLICY``, else the ``dags/trigger_policy.yaml`` beside this package."""
    if environ.get(POLICY_VARIABLE):
        return Path(environ[POLICY_VARIABLE])
    return Path(__file__).resolve().parents[1] / "dags" / POLICY_FILE_NAME


def load_trigger_policy(environ: Mapping[str, str] = os.environ) -> TriggerPolicy:
    """The deployment's policy (:func:`policy_file`); an absent file lists nothing but the default storage URL.

    A :class:`TriggerPolicyError` names the file and what is wrong with it.
    """
    path = policy_file(environ)
    try:
        stat = path.stat()
    except FileNotFoundError:
        lists = _PolicyFile()
        source = f"no policy file at {path}"
    else:
        lists = _parsed(path, stat.st_mtime_ns, stat.st_size)
        source = str(path)
    storage_urls = tuple(lists.storage.urls) or (default_storage_url(environ),)
    return TriggerPolicy(
        source=source,
        storage_urls=storage_urls,
        storage_connections=tuple(lists.storage.connections),
        server_connections=tuple(lists.servers.connections),
        models=tuple(lists.models),
    )


@functools.lru_cache(maxsize=8)
def _parsed(path: Path, _mtime_ns: int, _size: int) -> _PolicyFile:
    """One parse per version of the file (the DAG processor reads it on every parse)."""
    import yaml

    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        return _PolicyFile.model_validate(document)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise TriggerPolicyError(f"trigger policy {path}: cannot be read: {error}") from None
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}" for e in error.errors(include_url=False)
        )
        raise TriggerPolicyError(f"trigger policy {path}: {problems}") from None
