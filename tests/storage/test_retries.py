"""Retries of storage operations: which errors are transient, the bounded policy, the named give-up."""

from __future__ import annotations

import errno
import logging
import time

import pytest

from tasks.errors import ConfigError, ObjectConflictError, StorageIntegrityError, StorageUnavailableError
from tasks.storage.objects import ObjectStore
from tasks.storage.options import RETRY_VARIABLE
from tasks.storage.retries import RetryPolicy, call_with_retries, describe_error, is_transient

FAST = RetryPolicy(attempts=4, initial_wait_s=0.0001, max_wait_s=0.001)


def _botocore_errors() -> list[BaseException]:
    from botocore import exceptions

    return [
        exceptions.ReadTimeoutError(endpoint_url="http://s3"),
        exceptions.ConnectTimeoutError(endpoint_url="http://s3"),
        exceptions.EndpointConnectionError(endpoint_url="http://s3"),
        exceptions.ConnectionClosedError(endpoint_url="http://s3"),
    ]


def _aiohttp_errors() -> list[BaseException]:
    import aiohttp

    return [aiohttp.ServerDisconnectedError(), aiohttp.ClientPayloadError("cut short")]


TRANSIENT = [
    TimeoutError("timed out"),
    ConnectionResetError(errno.ECONNRESET, "reset by peer"),
    ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
    BrokenPipeError(errno.EPIPE, "broken pipe"),
    OSError(errno.EBUSY, "SlowDown"),  # s3fs: S3 503 SlowDown / ServiceUnavailable, 409 OperationAborted
    OSError(errno.EREMOTEIO, "InternalError"),  # s3fs: S3 500
    OSError(errno.EIO, "An error occurred (ConditionalRequestConflict)"),  # s3fs: a code it does not map
    OSError(errno.ESTALE, "stale file handle"),  # NFS
    OSError(errno.EAGAIN, "try again"),
]
PERMANENT = [
    FileNotFoundError(errno.ENOENT, "NoSuchKey"),
    FileExistsError(errno.EEXIST, "PreconditionFailed"),  # s3fs: If-None-Match lost
    ObjectConflictError("exists with different content"),
    PermissionError(errno.EACCES, "AccessDenied"),  # s3fs: also InvalidAccessKeyId, ExpiredToken
    IsADirectoryError(errno.EISDIR, "a directory"),
    NotADirectoryError(errno.ENOTDIR, "not a directory"),
    OSError(errno.EINVAL, "InvalidBucketName"),  # s3fs: 400-class codes
    OSError(errno.ENOSPC, "no space left on device"),
    OSError(errno.EROFS, "read-only file system"),
    OSError("no errno"),
    ValueError("object path 'a/../b' must be relative"),
    NotImplementedError("cannot create objects exclusively"),
    StorageIntegrityError("sha256 differs"),
    RuntimeError("a bug"),
]


@pytest.mark.parametrize("error", [*TRANSIENT, *_botocore_errors(), *_aiohttp_errors()], ids=describe_error)
def test_transient_errors_are_retried(error: BaseException) -> None:
    assert is_transient(error)


@pytest.mark.parametrize("error", PERMANENT, ids=describe_error)
def test_answers_and_bugs_are_never_retried(error: BaseException) -> None:
    assert not is_transient(error)


def _as_s3fs_raises(code: str) -> BaseException:
    """What s3fs raises for an S3 error response with ``code`` (its own translation of botocore's ClientError)."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    return translate_boto_error(ClientError({"Error": {"Code": code, "Message": f"the {code} answer"}}, "PutObject"))


PASSING_S3_ANSWERS = ("SlowDown", "ServiceUnavailable", "503", "InternalError", "500", "502", "504", "RequestTimeout")
STANDING_S3_ANSWERS = ("NoSuchKey", "NoSuchBucket", "404", "AccessDenied", "403", "InvalidAccessKeyId", "ExpiredToken")
STANDING_S3_REFUSALS = ("SignatureDoesNotMatch", "InvalidBucketName", "InvalidArgument", "PreconditionFailed")


@pytest.mark.parametrize("code", [*PASSING_S3_ANSWERS, "ConditionalRequestConflict", "OperationAborted"])
def test_s3_answers_that_pass_are_transient_as_s3fs_reports_them(code: str) -> None:
    assert is_transient(_as_s3fs_raises(code))


@pytest.mark.parametrize("code", [*STANDING_S3_ANSWERS, *STANDING_S3_REFUSALS])
def test_s3_answers_that_stand_are_not_retried(code: str) -> None:
    assert not is_transient(_as_s3fs_raises(code))


def test_missing_credentials_are_never_retried() -> None:
    from botocore.exceptions import NoCredentialsError, ParamValidationError

    assert not is_transient(NoCredentialsError())
    assert not is_transient(ParamValidationError(report="Invalid bucket name"))


def test_a_transient_error_is_retried_until_the_operation_succeeds(caplog: pytest.LogCaptureFixture) -> None:
    answers: list[BaseException | str] = [OSError(errno.EBUSY, "SlowDown secret-detail"), TimeoutError(), "done"]

    def action() -> str:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    with caplog.at_level(logging.WARNING, logger="tasks.storage.retries"):
        assert call_with_retries(FAST, "read", "s3://bucket/batches/b/plan/batch.json", action) == "done"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, "one line per retry"
    assert lines[0].startswith("storage read s3://bucket/batches/b/plan/batch.json: OSError[EBUSY] on attempt 1 of 4")
    assert "TimeoutError on attempt 2 of 4" in lines[1]
    assert not any("secret-detail" in line for line in lines), "a retry line names the error type, not its text"


def test_a_permanent_error_propagates_at_once_unchanged() -> None:
    missing = FileNotFoundError(errno.ENOENT, "NoSuchKey")
    calls = []

    def action() -> None:
        calls.append(1)
        raise missing

    with pytest.raises(FileNotFoundError) as raised:
        call_with_retries(FAST, "read", "s3://bucket/x", action)
    assert raised.value is missing
    assert len(calls) == 1


def test_exhausted_retries_raise_a_named_error_with_the_operation_object_attempts_and_cause() -> None:
    last = ConnectionResetError(errno.ECONNRESET, "reset by peer")

    def action() -> None:
        raise last

    with pytest.raises(StorageUnavailableError) as raised:
        call_with_retries(FAST, "write", "s3://bucket/batches/b/ledger/shard-00000/_COMMITTED.json", action)
    error = raised.value
    assert (error.reason, error.operation, error.attempts) == ("storage_unavailable", "write", 4)
    assert error.path == "s3://bucket/batches/b/ledger/shard-00000/_COMMITTED.json"
    assert error.last_error is last and error.__cause__ is last
    assert "write s3://bucket/batches/b/ledger/shard-00000/_COMMITTED.json failed 4 time(s)" in str(error)
    assert "ConnectionResetError" in str(error)
    assert not isinstance(error, (StorageIntegrityError, OSError)), "not an integrity or setup error: retryable"


def test_the_deadline_bounds_the_retries() -> None:
    policy = RetryPolicy(attempts=10_000, deadline_s=0.05, initial_wait_s=0.01, max_wait_s=0.01)
    calls = []

    def action() -> None:
        calls.append(time.monotonic())
        raise TimeoutError

    with pytest.raises(StorageUnavailableError) as raised:
        call_with_retries(policy, "list", "file:///root", action)
    # No wait is planned past the deadline; a loaded machine may overshoot a planned sleep a little.
    assert calls[-1] - calls[0] < 0.05 + 0.25, "no try starts well after the deadline"
    assert 1 < raised.value.attempts == len(calls) < 10_000, "the deadline, not the attempts, stopped the retries"


def test_one_attempt_turns_retries_off() -> None:
    calls = []

    def action() -> None:
        calls.append(1)
        raise TimeoutError

    with pytest.raises(StorageUnavailableError):
        call_with_retries(RetryPolicy(attempts=1), "exists", "file:///root/x", action)
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"attempts": 0}, "attempts"),
        ({"attempts": 2.5}, "attempts"),
        ({"deadline_s": -1}, "deadline_s"),
        ({"max_wait_s": float("nan")}, "max_wait_s"),
        ({"retries": 3}, "retries"),
        ("6", "mapping"),
    ],
)
def test_bad_retry_settings_are_refused_by_name(settings: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        RetryPolicy.of(settings)  # type: ignore[arg-type]


def test_a_store_takes_its_policy_from_the_storage_option_else_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    assert ObjectStore(str(tmp_path)).retry_policy == RetryPolicy()
    monkeypatch.setenv(RETRY_VARIABLE, '{"attempts": 9, "deadline_s": 5}')
    assert ObjectStore(str(tmp_path)).retry_policy == RetryPolicy(attempts=9, deadline_s=5)
    store = ObjectStore(str(tmp_path), rollout_ledger_retry={"attempts": 2})
    assert store.retry_policy == RetryPolicy(attempts=2)
    assert store.child("batches/b").retry_policy == store.retry_policy
    monkeypatch.setenv(RETRY_VARIABLE, "[1]")
    with pytest.raises(ConfigError, match=RETRY_VARIABLE):
        ObjectStore(str(tmp_path))


def _dead_endpoint() -> str:
    """A loopback port nothing listens on: connections are refused at once."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _botocore_config(store: ObjectStore):
    store.fs.connect()
    return store.fs.s3.meta.config


def test_a_dead_s3_endpoint_fails_within_the_policy_deadline_with_botocore_trying_once() -> None:
    deadline = 1.0
    store = ObjectStore(
        "s3://bucket/root",
        endpoint_url=_dead_endpoint(),
        key="k",
        secret="s",
        skip_instance_cache=True,
        rollout_ledger_retry={"attempts": 1000, "deadline_s": deadline, "initial_wait_s": 0.05, "max_wait_s": 0.2},
    )
    config = _botocore_config(store)
    assert config.retries["total_max_attempts"] == 1 and config.connect_timeout == 3
    assert store.fs.retries == 1  # s3fs's own loop tries once too
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError) as raised:
        store.exists("plan/batch.json")
    elapsed = time.monotonic() - started
    assert elapsed < deadline + 1.0, f"gave up after {elapsed:.1f} s: another retry loop runs inside the policy"
    assert raised.value.attempts > 1, "the policy, not botocore, retried"


def test_config_kwargs_of_the_options_win_key_by_key_over_the_s3_defaults() -> None:
    own = {"connect_timeout": 10, "read_timeout": 99}
    store = ObjectStore("s3://bucket/root", endpoint_url=_dead_endpoint(), skip_instance_cache=True, config_kwargs=own)
    config = _botocore_config(store)
    assert (config.connect_timeout, config.read_timeout, config.retries["total_max_attempts"]) == (10, 99, 1)
    assert own == {"connect_timeout": 10, "read_timeout": 99}  # the caller's mapping is left as it was
    retries = {"mode": "standard", "total_max_attempts": 4}
    store = ObjectStore(
        "s3://bucket/root", endpoint_url=_dead_endpoint(), skip_instance_cache=True, config_kwargs={"retries": retries}
    )
    assert _botocore_config(store).retries == retries
    with pytest.raises(ConfigError, match="config_kwargs must be a mapping"):
        ObjectStore("s3://bucket/root", skip_instance_cache=True, config_kwargs=["retries"])
