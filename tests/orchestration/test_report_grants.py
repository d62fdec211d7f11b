"""Grants to read one run's reports: signed for that run, expiring, unforgeable without the api-server's secret."""

from __future__ import annotations

import re

import pytest

from tasks.orchestration.report_grants import GRANT_SECONDS, GrantError, check_grant, mint_grant

SECRET = "the api-server's secret key"
NOW = 1_800_000_000.0


def test_a_grant_reads_its_run_until_it_expires():
    grant = mint_grant(SECRET, "rollout_batch", "manual__1", now=NOW)
    assert re.fullmatch(r"[0-9A-Za-z_-]+", grant)  # one plain URL path segment
    check_grant(SECRET, grant, "rollout_batch", "manual__1", now=NOW + GRANT_SECONDS - 1)
    with pytest.raises(GrantError, match="expired"):
        check_grant(SECRET, grant, "rollout_batch", "manual__1", now=NOW + GRANT_SECONDS)


@pytest.mark.parametrize(
    ("secret", "dag_id", "run_id"),
    [
        (SECRET, "rollout_batch", "manual__2"),
        (SECRET, "other_dag", "manual__1"),
        ("another deployment's secret", "rollout_batch", "manual__1"),
    ],
)
def test_a_grant_reads_no_other_run_and_no_other_deployment(secret, dag_id, run_id):
    grant = mint_grant(SECRET, "rollout_batch", "manual__1", now=NOW)
    with pytest.raises(GrantError, match="not for this run"):
        check_grant(secret, grant, dag_id, run_id, now=NOW)


def test_a_grant_whose_expiry_was_moved_or_that_is_malformed_reads_nothing():
    expires, mac = mint_grant(SECRET, "rollout_batch", "manual__1", now=NOW).split("-", 1)
    with pytest.raises(GrantError, match="not for this run"):
        check_grant(SECRET, f"{int(expires) + 86400}-{mac}", "rollout_batch", "manual__1", now=NOW)
    for malformed in ("", expires, f"{expires}-", f"{expires}-{mac[:-1]}", f"-{mac}", f"{expires}-{mac}/x"):
        with pytest.raises(GrantError, match="malformed"):
            check_grant(SECRET, malformed, "rollout_batch", "manual__1", now=NOW)
