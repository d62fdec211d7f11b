"""scoped_environ: every variable it names is exactly as it was after the block, on every path."""

from __future__ import annotations

import os

import pytest

from tasks.env_vars import scoped_environ

UNSET = "ROLLOUT_LEDGER_TEST_UNSET"
PREVIOUS = "ROLLOUT_LEDGER_TEST_PREVIOUS"


@pytest.fixture(autouse=True)
def variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UNSET, raising=False)
    monkeypatch.setenv(PREVIOUS, "user-choice")


def test_values_are_set_within_the_block() -> None:
    with scoped_environ(**{UNSET: "1", PREVIOUS: "0-1"}):
        assert (os.environ[UNSET], os.environ[PREVIOUS]) == ("1", "0-1")


def test_a_previous_value_comes_back_and_an_unset_variable_is_removed() -> None:
    with scoped_environ(**{UNSET: "1", PREVIOUS: "0-1"}):
        pass
    assert UNSET not in os.environ
    assert os.environ[PREVIOUS] == "user-choice"


def test_variables_are_restored_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="inside"), scoped_environ(**{UNSET: "1", PREVIOUS: "0-1"}):
        raise RuntimeError("inside")
    assert UNSET not in os.environ
    assert os.environ[PREVIOUS] == "user-choice"


def test_a_variable_changed_inside_the_block_is_restored_too() -> None:
    with scoped_environ(**{PREVIOUS: "0-1"}):
        os.environ[PREVIOUS] = "changed by the engine"
    assert os.environ[PREVIOUS] == "user-choice"


def test_no_values_change_nothing() -> None:
    before = dict(os.environ)
    with scoped_environ():
        assert dict(os.environ) == before
    assert dict(os.environ) == before
