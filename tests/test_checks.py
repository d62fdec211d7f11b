"""Shared value checks: the value back when it passes, else the field named with the right error class."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tasks.checks import (
    check_choice,
    check_finite,
    check_hex_digest,
    check_int,
    check_reason,
    check_text,
    check_u64,
)


class DomainError(ValueError):
    """Stands in for a caller's own error class (ConfigError, MalformedMarkerError)."""


def test_check_int_returns_a_python_int_for_ints_and_numpy_ints() -> None:
    assert check_int(3, field="n") == 3
    value = check_int(np.int64(3), field="n", minimum=1, maximum=3)
    assert value == 3 and type(value) is int


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (True, TypeError, "n must be an int >= 0, got True"),
        (np.bool_(True), TypeError, "n must be an int >= 0"),
        (1.0, TypeError, "n must be an int >= 0, got 1.0"),
        ("1", TypeError, "n must be an int >= 0"),
        (-1, ValueError, "n must be an int >= 0, got -1"),
    ],
)
def test_check_int_refuses_bools_non_ints_and_values_below_the_minimum(
    value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        check_int(value, field="n")
    assert type(raised.value) is error
    assert message in str(raised.value)


def test_check_int_bounds_read_as_the_integer_types_they_are() -> None:
    with pytest.raises(ValueError, match=r"weight_version must be an int in \[0, 2\*\*64\), got 18446744073709551616"):
        check_u64(2**64, field="weight_version")
    with pytest.raises(ValueError, match=r"top_k must be an int in \[-2\*\*31, 2\*\*31\)"):
        check_int(2**31, field="top_k", minimum=-(2**31), maximum=2**31 - 1)
    with pytest.raises(ValueError, match=r"x must be an int in \[1, 10\)"):
        check_int(10, field="x", minimum=1, maximum=9)


@pytest.mark.parametrize(
    "check",
    [
        lambda error: check_int(True, field="f", error=error),
        lambda error: check_int(-1, field="f", error=error),
        lambda error: check_finite("x", field="f", error=error),
        lambda error: check_finite(math.nan, field="f", error=error),
        lambda error: check_hex_digest(b"ab" * 32, field="f", error=error),
        lambda error: check_hex_digest("AB" * 32, field="f", error=error),
        lambda error: check_reason("Not a reason", field="f", error=error),
        lambda error: check_text("", field="f", error=error),
        lambda error: check_text(None, field="f", error=error),
        lambda error: check_choice("c", ("a", "b"), field="f", error=error),
    ],
)
def test_a_given_error_class_is_raised_for_every_failure(check) -> None:
    with pytest.raises(DomainError, match=r"^f"):
        check(DomainError)


def test_check_hex_digest_takes_64_lowercase_hex_digits_only() -> None:
    assert check_hex_digest("ab" * 32, field="sha256") == "ab" * 32
    for bad in ("AB" * 32, "ab" * 31, "ab" * 32 + "\n", "gg" * 32):
        with pytest.raises(ValueError, match="sha256 must be 64 lowercase hex digits"):
            check_hex_digest(bad, field="sha256")
    with pytest.raises(TypeError, match="sha256"):
        check_hex_digest(b"ab" * 32, field="sha256")


def test_check_finite_returns_a_float_and_refuses_bools_nan_and_infinity() -> None:
    assert check_finite(2, field="t") == 2.0
    assert check_finite(np.float32(0.5), field="t") == 0.5
    with pytest.raises(TypeError, match="t must be a finite number"):
        check_finite(False, field="t")
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="t must be a finite number"):
            check_finite(bad, field="t")


def test_names_reasons_and_choices() -> None:
    assert check_reason("context_length", field="reason") == "context_length"
    for bad in ("Context", "_x", "9x", "a-b", "", None):
        with pytest.raises(ValueError, match="reason must be a snake_case reason name"):
            check_reason(bad, field="reason")
    assert check_text("x", field="name") == "x"
    with pytest.raises(ValueError, match=r"mode must be one of \['a', 'b'\], got 'c'"):
        check_choice("c", ("a", "b"), field="mode")
