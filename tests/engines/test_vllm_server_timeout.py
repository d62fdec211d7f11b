"""A model call to a server never times out while a refit pause may still hold it.

A refit (``/pause?mode=keep`` ... ``/resume``) freezes the calls in flight for as long as its calls
take, each up to :data:`REFIT_TIMEOUT_SECONDS`; ``request_timeout_s`` is never below that: a shorter
value is raised to it (refusing it would make batch configs that hold one unreadable).
"""

from __future__ import annotations

import asyncio

import pytest

from tasks.config import EngineSpec
from tasks.engines.registry import options_schema
from tasks.engines.vllm_server import refit
from tasks.engines.vllm_server.claims import replicas_of
from tasks.engines.vllm_server.options import (
    DEFAULT_REQUEST_TIMEOUT_SECONDS,
    REFIT_TIMEOUT_SECONDS,
    VllmServerOptions,
)

URLS = ["http://127.0.0.1:8000"]


def test_the_refit_and_the_calls_share_one_pause_length_and_the_default_outlasts_it() -> None:
    assert refit.REFIT_TIMEOUT_SECONDS is REFIT_TIMEOUT_SECONDS
    assert VllmServerOptions(urls=URLS).request_timeout_s == DEFAULT_REQUEST_TIMEOUT_SECONDS > REFIT_TIMEOUT_SECONDS


@pytest.mark.parametrize("seconds", [600.0, REFIT_TIMEOUT_SECONDS - 0.5, 1])
def test_a_request_timeout_shorter_than_a_refit_pause_is_raised_to_it(seconds: float) -> None:
    assert VllmServerOptions(urls=URLS, request_timeout_s=seconds).request_timeout_s == REFIT_TIMEOUT_SECONDS


def test_a_batch_config_planned_with_a_shorter_request_timeout_still_reads() -> None:
    engine = EngineSpec(name="vllm_server", options={"urls": URLS, "request_timeout_s": 600.0})
    assert engine.options["request_timeout_s"] == 600.0  # recorded as given; calls wait at least a pause


@pytest.mark.parametrize("seconds", [True, "3600", 0, -1.0, float("inf"), float("nan")])
def test_a_request_timeout_that_is_no_positive_finite_number_is_refused(seconds: object) -> None:
    with pytest.raises(ValueError, match="engine option request_timeout_s must be a number > 0"):
        VllmServerOptions(urls=URLS, request_timeout_s=seconds)


def test_a_longer_request_timeout_is_kept_and_the_form_describes_the_rule() -> None:
    assert VllmServerOptions(urls=URLS, request_timeout_s=7200).request_timeout_s == 7200.0
    schema = options_schema("vllm_server")["properties"]["request_timeout_s"]
    assert schema["default"] == DEFAULT_REQUEST_TIMEOUT_SECONDS
    assert f"below a refit pause ({REFIT_TIMEOUT_SECONDS:g} s" in schema["description"]


@pytest.mark.parametrize("seconds", [None, 60.0])
def test_no_http_timeout_of_a_call_is_shorter_than_a_refit_pause(seconds: float | None) -> None:
    """Reading the answer, sending the body and waiting for a pooled connection all outlast a pause; only
    connecting is short (a paused server still accepts connections: the pause is in its engine)."""
    options = VllmServerOptions(urls=URLS, **({} if seconds is None else {"request_timeout_s": seconds}))
    (replica,) = replicas_of(options)
    try:
        timeout = replica._client.timeout
        assert min(timeout.read, timeout.write, timeout.pool) >= REFIT_TIMEOUT_SECONDS
        assert timeout.read == options.request_timeout_s and timeout.connect == 10.0
    finally:
        asyncio.run(replica.close())
