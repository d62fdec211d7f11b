"""Generate's progress log lines: every ``$ROLLOUT_LEDGER_PROGRESS_SECONDS`` (10 s unless set), checked first."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from tasks.batch import Batch
from tasks.errors import ConfigError
from tasks.generate import generate_shard
from tasks.generate.progress import DEFAULT_HEARTBEAT_SECONDS, HEARTBEAT_VARIABLE, Progress, heartbeat_seconds
from tasks.plan import plan_batch
from tasks.storage.claims import read_claims

from .configs import fake_model_config
from .fakes import FakeScriptedEngine


def test_the_interval_is_ten_seconds_unless_the_variable_sets_it() -> None:
    assert heartbeat_seconds({}) == DEFAULT_HEARTBEAT_SECONDS == 10.0
    assert heartbeat_seconds({HEARTBEAT_VARIABLE: "0.5"}) == 0.5
    assert heartbeat_seconds({HEARTBEAT_VARIABLE: "3600"}) == 3600.0


@pytest.mark.parametrize("text", ["", "ten", "0", "-1", "nan", "inf", "3601"])
def test_a_value_that_is_not_seconds_in_range_is_a_config_error_naming_the_variable(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"\${HEARTBEAT_VARIABLE} must be seconds in \(0, 3600\], got {text!r}"):
        heartbeat_seconds({HEARTBEAT_VARIABLE: text})


def test_without_a_bar_a_line_is_logged_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    progress = Progress(total=4, enabled=False, label="shard 3", every_s=0.05)
    progress.rollout_done()

    async def beat_for(seconds: float) -> None:
        beating = asyncio.create_task(progress.heartbeat())
        await asyncio.sleep(seconds)
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating

    with caplog.at_level(logging.INFO, logger="tasks.generate.progress"):
        asyncio.run(beat_for(0.32))
    lines = [r.getMessage() for r in caplog.records if r.name == "tasks.generate.progress"]
    assert 4 <= len(lines) <= 7, lines
    assert all(line.startswith("shard 3: 1/4 rollouts done, 0 calls") for line in lines), lines


def test_generate_refuses_a_bad_interval_before_it_claims_an_attempt(tmp_path, tokenizer, monkeypatch) -> None:
    config = fake_model_config()
    root = str(tmp_path / "runs")
    plan_batch(Batch.open(root, config.batch_id), config)
    monkeypatch.setenv(HEARTBEAT_VARIABLE, "soon")
    engine = FakeScriptedEngine(tokenizer)
    with pytest.raises(ConfigError, match=HEARTBEAT_VARIABLE):
        generate_shard(Batch.open(root, config.batch_id), 0, engine=engine, run=asyncio.run, progress=False)
    assert engine.requests == [] and read_claims(Batch.open(root, config.batch_id).store, 0) == []
