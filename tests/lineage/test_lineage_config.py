"""Where the CLI's lineage goes: the OpenLineage client's own configuration, or the provider's transport variable.

Nothing here is sent: each sink is only built (a file transport's file is written on the first event).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tasks.errors import ConfigError
from tasks.lineage.emit import NO_LINEAGE, EventSink

from .client_env import sink_under


def file_transport(path: Path) -> str:
    return json.dumps({"type": "file", "log_file_path": str(path), "append": True})


def transport_kind(sink: EventSink) -> str:
    return sink.client.transport.kind


def test_without_any_configuration_nothing_is_emitted_and_the_clients_console_fallback_is_not_announced(
    tmp_path, caplog
):
    with caplog.at_level(logging.INFO):
        assert sink_under({}, tmp_path) is NO_LINEAGE
    assert "console" not in caplog.text


@pytest.mark.parametrize(
    "switch",
    [{"OPENLINEAGE_DISABLED": "true"}, {"AIRFLOW__OPENLINEAGE__DISABLED": "True"}],
    ids=lambda s: next(iter(s)),
)
def test_either_disabled_variable_turns_a_configured_transport_off(switch, tmp_path):
    configured = {"AIRFLOW__OPENLINEAGE__TRANSPORT": file_transport(tmp_path / "e.jsonl")}
    assert isinstance(sink_under(configured, tmp_path), EventSink)
    assert sink_under({**configured, **switch}, tmp_path) is NO_LINEAGE


def test_the_clients_own_settings_choose_the_transport(tmp_path):
    events = tmp_path / "events.jsonl"
    yaml_file = tmp_path / "elsewhere.yml"
    yaml_file.write_text(f"transport:\n  type: file\n  log_file_path: {events}\n")
    assert transport_kind(sink_under({"OPENLINEAGE_CONFIG": str(yaml_file)}, tmp_path)) == "file"
    (tmp_path / "openlineage.yml").write_text(yaml_file.read_text())  # found in the working directory
    assert transport_kind(sink_under({}, tmp_path)) == "file"
    (tmp_path / "openlineage.yml").unlink()
    assert transport_kind(sink_under({"OPENLINEAGE__TRANSPORT__TYPE": "console"}, tmp_path)) == "console"
    sink = sink_under({"OPENLINEAGE_URL": "http://127.0.0.1:9", "OPENLINEAGE_API_KEY": "ol-key-leakcheck"}, tmp_path)
    assert transport_kind(sink) == "http" and "ol-key-leakcheck" not in (sink.describe() or "")


def test_the_providers_transport_variable_wins_and_its_namespace_names_the_jobs(tmp_path):
    environ = {
        "AIRFLOW__OPENLINEAGE__TRANSPORT": file_transport(tmp_path / "e.jsonl"),
        "OPENLINEAGE__TRANSPORT__TYPE": "console",
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "ledger",
    }
    sink = sink_under(environ, tmp_path)
    assert isinstance(sink, EventSink) and (transport_kind(sink), sink.namespace) == ("file", "ledger")


@pytest.mark.parametrize(
    ("value", "needle"),
    [("{file", "AIRFLOW__OPENLINEAGE__TRANSPORT is not JSON"), ('{"log_file_path": "x"}', "a JSON object with a type")],
)
def test_a_provider_transport_that_is_not_one_is_named(value, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle):
        sink_under({"AIRFLOW__OPENLINEAGE__TRANSPORT": value}, tmp_path)
