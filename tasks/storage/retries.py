"""Retries of storage operations on transient errors: bounded exponential backoff with full jitter (tenacity).

Every :class:`~tasks.storage.objects.ObjectStore` operation runs through :func:`call_with_retries`.
Only errors that name a passing condition are retried (:func:`is_transient`): timeouts, dropped
connections, S3 throttling and 5xx answers, and ``OSError``s with a transient errno. A missing
object, an existing one (the create-once conflict), a permission or credential problem and a bad
path are answers, not faults: they propagate at once, unchanged. When the retries run out,
:class:`~tasks.errors.StorageUnavailableError` names the operation, the object, the attempts
and the last error, so a stage fails closed with a reason instead of a bare network error.

Retrying a create-once write is safe: an identical re-write of an object that landed is a no-op,
which is what an ambiguous failure (the write landed, its answer was lost) turns into.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import tenacity

from tasks.checks import check_finite, check_int
from tasks.errors import StorageUnavailableError

T = TypeVar("T")
log = logging.getLogger(__name__)

# Answers, not faults: never retried (ObjectConflictError is a FileExistsError).
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)
# errno values of conditions that pass. s3fs turns S3's 503 SlowDown / ServiceUnavailable and 409
# conflicts into EBUSY, a 500 InternalError into EREMOTEIO, and an error code it does not know
# (502, 504, ConditionalRequestConflict) into EIO.
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EINTR,
        errno.EBUSY,
        errno.EIO,
        errno.EREMOTEIO,
        errno.ETIMEDOUT,
        errno.ESTALE,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.ENETRESET,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    """How an operation is retried: at most ``attempts`` tries, no wait that would end past ``deadline_s``
    seconds after the first try began, and before try n+1 a random wait of up to
    ``initial_wait_s * 2**(n-1)`` seconds, capped at ``max_wait_s`` (exponential backoff, full jitter).

    ``attempts=1`` turns retries off. Set per store with the storage option
    :data:`~tasks.storage.options.RETRY_OPTION` (a mapping of these fields).
    """

    attempts: int = 6
    deadline_s: float = 60.0
    initial_wait_s: float = 0.2
    max_wait_s: float = 10.0

    def __post_init__(self) -> None:
        from tasks.errors import ConfigError

        check_int(self.attempts, field="storage retry attempts", minimum=1, error=ConfigError)
        for name in ("deadline_s", "initial_wait_s", "max_wait_s"):
            if check_finite(getattr(self, name), field=f"storage retry {name}", error=ConfigError) < 0:
                raise ConfigError(f"storage retry {name} must be >= 0, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, option: RetryPolicy | Mapping[str, Any] | None) -> RetryPolicy:
        """The policy a storage option names: the defaults, overridden by the fields it sets (others are refused)."""
        from tasks.errors import ConfigError

        if option is None or isinstance(option, RetryPolicy):
            return option or cls()
        if not isinstance(option, Mapping):
            raise ConfigError(f"storage retry settings must be a mapping, got {type(option).__name__}")
        unknown = sorted(set(option) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown storage retry setting(s) {unknown}; known: {[f.name for f in fields(cls)]}")
        return cls(**option)


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` names a condition that may pass, so the operation is worth another try."""
    if isinstance(error, PERMANENT_ERRORS):
        return False
    if isinstance(error, (TimeoutError, ConnectionError, *_network_errors())):
        return True
    return isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS


@functools.cache
def _network_errors() -> tuple[type[BaseException], ...]:
    """Dropped connections and timeouts of the S3 client stack that reach us untranslated (when installed)."""
    found: list[type[BaseException]] = []
    try:
        from botocore import exceptions as botocore
    except ImportError:
        pass
    else:  # HTTPClientError: read timeouts, closed connections; ConnectionError: endpoint, connect timeout
        found += [botocore.HTTPClientError, botocore.ConnectionError, botocore.IncompleteReadError]
    try:
        import aiohttp
    except ImportError:
        pass
    else:
        found += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    return tuple(found)


def call_with_retries(policy: RetryPolicy, operation: str, where: str, action: Callable[[], T]) -> T:
    """``action()``, tried again per ``policy`` while it raises transient errors.

    A permanent error propagates unchanged at once; a transient one that outlasts the policy
    becomes :class:`StorageUnavailableError` (naming ``operation`` and ``where``, caused by it).
    Each retry logs one line: operation, object, attempt, error type and the wait.
    """

    def give_up(state: tenacity.RetryCallState) -> T:
        error = state.outcome.exception()  # type: ignore[union-attr]
        raise StorageUnavailableError(
            operation, where, attempts=state.attempt_number, seconds=state.seconds_since_start or 0.0, last_error=error
        ) from error

    def log_retry(state: tenacity.RetryCallState) -> None:
        log.warning(
            "storage %s %s: %s on attempt %d of %d; retrying in %.2f s",
            operation,
            where,
            describe_error(state.outcome.exception()),  # type: ignore[union-attr]
            state.attempt_number,
            policy.attempts,
            state.upcoming_sleep,
        )

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.attempts) | tenacity.stop_before_delay(policy.deadline_s),
        wait=tenacity.wait_random_exponential(multiplier=policy.initial_wait_s, max=policy.max_wait_s),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=log_retry,
        retry_error_callback=give_up,
    )
    return retrying(action)


def describe_error(error: BaseException | None) -> str:
    """The error's type, with its errno's name when it has one (``OSError[EBUSY]``): no message, no secrets."""
    code = getattr(error, "errno", None)
    name = type(error).__name__
    return f"{name}[{errno.errorcode.get(code, code)}]" if isinstance(code, int) else name
