"""Value checks shared by records, markers and configs: ints, hex digests, finite numbers, names.

Each rule is a predicate (``is_*``, for callers that decide what to raise) and a checker
(``check_*``) that returns the value or raises naming the field and the value. A checker raises
``TypeError`` for a value of the wrong type and ``ValueError`` for one out of range, or
``error`` for both when given (a config or a marker raises its own error class). Identifiers
have their own module, :mod:`tasks.ids`.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Collection
from typing import TypeVar

HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
REASON_NAME = re.compile(r"[a-z][a-z0-9_]*")
U64_MAX = 2**64 - 1
T = TypeVar("T")


def is_int(value: object) -> bool:
    """An int (a numpy integer too: numpy registers them as ``numbers.Integral``), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float (numpy ones too, as ``numbers.Real``), never a bool (numpy's ``bool_`` is not a number)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_hex_digest(value: object) -> bool:
    """A SHA-256 digest as 64 lowercase hex digits."""
    return isinstance(value, str) and HEX_DIGEST.fullmatch(value) is not None


def is_reason(value: object) -> bool:
    """A stable reason name: snake_case, starting with a letter."""
    return isinstance(value, str) and REASON_NAME.fullmatch(value) is not None


def check_int(
    value: object,
    *,
    field: str,
    minimum: int = 0,
    maximum: int | None = None,
    error: type[Exception] | None = None,
) -> int:
    """``value`` as a Python int when it is an int in ``[minimum, maximum]``, else raise naming ``field``."""
    if not is_int(value):
        raise (error or TypeError)(f"{field} must be an int {_bounds(minimum, maximum)}, got {value!r}")
    number = int(value)  # type: ignore[call-overload]
    if number < minimum or (maximum is not None and number > maximum):
        raise (error or ValueError)(f"{field} must be an int {_bounds(minimum, maximum)}, got {value!r}")
    return number


def check_u64(value: object, *, field: str, error: type[Exception] | None = None) -> int:
    """``value`` as a Python int in [0, 2**64): what a ``>Q`` field and a uint64 column hold."""
    return check_int(value, field=field, maximum=U64_MAX, error=error)


def check_finite(value: object, *, field: str, error: type[Exception] | None = None) -> float:
    """``value`` as a float when it is a finite number, else raise naming ``field``."""
    if not is_number(value):
        raise (error or TypeError)(f"{field} must be a finite number, got {value!r}")
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise (error or ValueError)(f"{field} must be a finite number, got {value!r}")
    return number


def check_hex_digest(value: object, *, field: str, error: type[Exception] | None = None) -> str:
    """``value`` when it is 64 lowercase hex digits (a SHA-256 digest), else raise naming ``field``."""
    if not isinstance(value, str):
        raise (error or TypeError)(f"{field} must be 64 lowercase hex digits, got {type(value).__name__}")
    if not is_hex_digest(value):
        raise (error or ValueError)(f"{field} must be 64 lowercase hex digits, got {value[:80]!r}")
    return value


def check_reason(value: object, *, field: str, error: type[Exception] | None = None) -> str:
    """``value`` when it is a snake_case reason name, else raise naming ``field``."""
    if not is_reason(value):
        raise (error or ValueError)(f"{field} must be a snake_case reason name, got {value!r}")
    return value  # type: ignore[return-value]


def check_text(value: object, *, field: str, error: type[Exception] | None = None) -> str:
    """``value`` when it is a non-empty str, else raise naming ``field``."""
    if not isinstance(value, str):
        raise (error or TypeError)(f"{field} must be a non-empty str, got {value!r}")
    if not value:
        raise (error or ValueError)(f"{field} must be a non-empty str, got {value!r}")
    return value


def check_choice(value: T, allowed: Collection[T], *, field: str, error: type[Exception] | None = None) -> T:
    """``value`` when it is one of ``allowed``, else raise naming ``field`` and the choices."""
    if value not in allowed:
        raise (error or ValueError)(f"{field} must be one of {list(allowed)}, got {value!r}")
    return value


def _bounds(minimum: int, maximum: int | None) -> str:
    if maximum is None:
        return f">= {minimum}"
    return f"in [{_power(minimum)}, {_power(maximum + 1)})"


def _power(bound: int) -> str:
    """A bound as ``2**k`` / ``-2**k`` when it is one past 255 (the edges of the integer types)."""
    magnitude = abs(bound)
    if magnitude > 255 and magnitude & (magnitude - 1) == 0:
        return f"{'-' if bound < 0 else ''}2**{magnitude.bit_length() - 1}"
    return str(bound)
