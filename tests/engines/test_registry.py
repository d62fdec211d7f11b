"""The engine registry: names and labels, options checked by name, options as JSON Schema, a light import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pytest

from tasks.engines import registry
from tasks.engines.base import Engine
from tasks.engines.megatron.options import MegatronOptions
from tasks.engines.vllm.options import VllmOptions

HEAVY_MODULES = ("numpy", "pyarrow", "fsspec", "torch", "vllm", "megatron", "transformers")
LIGHT_IMPORT = """
import json, sys
import tasks.engines, tasks.engines.registry, tasks.engines.options
import tasks.engines.vllm.options, tasks.engines.megatron.options
from tasks.engines.registry import check_engine, engine_labels, options_schema
engine_labels()
options_schema("vllm")
check_engine("megatron", {"dtype": "float32"})
print(json.dumps(sorted(name for name in sys.argv[1:] if name in sys.modules)))
"""


def test_importing_the_registry_and_the_options_imports_no_engine_stack() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", LIGHT_IMPORT, *HEAVY_MODULES],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert json.loads(completed.stdout) == []


def test_names_and_labels_come_from_the_registry() -> None:
    assert registry.engine_names() == ("vllm", "vllm_server", "megatron")
    assert registry.engine_labels() == {
        "vllm": "vLLM",
        "vllm_server": "vLLM servers (running vllm serve)",
        "megatron": "Megatron-core (GPU workers)",
    }


@pytest.mark.parametrize("name", registry.engine_names())
def test_each_entry_names_an_engine_class_that_the_registry_can_start(name: str) -> None:
    cls = registry.engine_class(name)
    assert issubclass(cls, Engine) and cls.name == name
    assert cls.create.__func__ is not Engine.create.__func__


def test_check_engine_returns_the_options_it_would_start_with() -> None:
    assert registry.check_engine("vllm", None) == VllmOptions()
    assert registry.check_engine("megatron", {"max_requests": 8}) == MegatronOptions(max_requests=8)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("sglang", {}, "unknown engine 'sglang'; known: vllm, vllm_server, megatron"),
        (None, {}, "unknown engine None"),
        ("vllm", {"max_len": 10}, r"unknown vllm engine option\(s\) \['max_len'\]; known: \[.*\] \(others go in"),
        ("vllm", {"max_model_len": "2048"}, "engine option max_model_len must be an int >= 2 or null, got '2048'"),
        ("vllm", {"enforce_eager": 1}, "engine option enforce_eager must be true or false or null, got 1"),
        ("vllm", [("dtype", "float32")], "vllm engine options must be a JSON object"),
        ("megatron", {"seed": -1}, "engine option seed must be an int >= 0, got -1"),
        ("vllm_server", {}, "engine option urls must be"),
        ("vllm_server", {"urls": []}, "engine option urls must be"),
        ("vllm_server", {"urls": ["127.0.0.1:8000"]}, "is not an http\\(s\\) URL with a host"),
        ("vllm_server", {"urls": ["http://a:1", "http://a:1/"]}, "names a server twice"),
        ("vllm_server", {"urls": ["http://u:s3cret@a:1"]}, r"^(?!.*s3cret).*'http://a:1' carries credentials"),
        (
            "vllm_server",
            {"urls": ["http://a:1"], "max_model_len": 1},
            "engine option max_model_len must be an int >= 2",
        ),
        ("megatron", {"kv_cache_gb": True}, "engine option kv_cache_gb must be a number > 0, got True"),
    ],
)
def test_a_bad_engine_or_option_is_a_value_error_naming_it(name: object, options: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        registry.check_engine(name, options)


def test_every_problem_is_named_in_one_message() -> None:
    with pytest.raises(ValueError, match=r"^unknown vllm engine option\(s\) \['typo'\]") as caught:
        registry.check_engine("vllm", {"max_model_len": 1, "tensor_parallel_size": 0, "typo": 1})
    _, bad_length, bad_size = str(caught.value).rsplit("; ", 2)
    assert bad_length == "engine option max_model_len must be an int >= 2 or null, got 1"
    assert bad_size == "engine option tensor_parallel_size must be an int >= 1, got 0"


def test_options_are_frozen() -> None:
    options = registry.check_engine("vllm", {})
    with pytest.raises(ValueError, match="frozen"):
        options.seed = 3


@pytest.mark.parametrize("name", registry.engine_names())
def test_the_schema_describes_every_option_and_refuses_unknown_ones(name: str) -> None:
    schema = registry.options_schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    fields = registry.options_model(name).model_fields
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(fields)
    assert all(prop.get("description") for prop in schema["properties"].values())
    validator = jsonschema.Draft202012Validator(schema)
    valid = {"urls": ["http://127.0.0.1:8000"]} if name == "vllm_server" else {"seed": 1}
    assert validator.is_valid({**valid, "max_model_len": 4096})
    assert not validator.is_valid({**valid, "max_model_len": 1})
    assert not validator.is_valid({"no_such_option": 1})


def test_the_schema_carries_choices_and_bounds() -> None:
    megatron = registry.options_schema("megatron")["properties"]
    assert megatron["dtype"]["enum"] == ["bfloat16", "float32"]
    assert megatron["max_requests"]["minimum"] == 1
    assert megatron["kv_cache_gb"]["exclusiveMinimum"] == 0
    vllm = registry.options_schema("vllm")["properties"]
    assert {"type": "integer", "minimum": 2} in vllm["max_model_len"]["anyOf"]
