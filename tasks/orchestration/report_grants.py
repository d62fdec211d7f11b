"""Signed, short-lived grants to read one run's reports: how a sandboxed report page reaches its other files.

The report viewer serves every report file sandboxed, in an opaque origin, and a browser sends
Airflow's session cookie (``SameSite=Lax``) with no request such a page makes: not its style
sheets and images, not a link followed inside the Airflow UI's frame. So the viewer's
authenticated routes answer with a redirect to the same file below ``signed/<grant>/``, and
relative links keep the grant: the pages and files of one run's reports reach each other through it.

A grant names no user: it is minted only after Airflow authenticated the reader and checked
read access to the DAG's runs, and it reads the reports of that one run (``dag_id``, ``run_id``)
for :data:`GRANT_SECONDS`, nothing else. It is ``<expiry>-<mac>``: the expiry in seconds since
the epoch and an HMAC-SHA256 of the run and the expiry under the api-server's ``[api] secret_key``
(the key Airflow signs its own tokens with; every api-server of a deployment shares it).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time

GRANT_SECONDS = 3600
GRANT = re.compile(r"(\d{1,12})-([A-Za-z0-9_-]{43})")


class GrantError(PermissionError):
    """A grant that is malformed, signed for another run, forged or expired (answered 403)."""


def mint_grant(secret: str, dag_id: str, run_id: str, *, now: float | None = None) -> str:
    """A grant to read the reports of run ``run_id`` of ``dag_id`` for :data:`GRANT_SECONDS`."""
    expires = int(time.time() if now is None else now) + GRANT_SECONDS
    return f"{expires}-{_mac(secret, dag_id, run_id, expires)}"


def check_grant(secret: str, grant: str, dag_id: str, run_id: str, *, now: float | None = None) -> None:
    """Return when ``grant`` reads run ``run_id`` of ``dag_id`` now; :class:`GrantError` otherwise."""
    match = GRANT.fullmatch(grant)
    if match is None:
        raise GrantError("malformed grant")
    expires = int(match.group(1))
    if not hmac.compare_digest(match.group(2), _mac(secret, dag_id, run_id, expires)):
        raise GrantError("the grant is not for this run")
    if expires <= (time.time() if now is None else now):
        raise GrantError("the grant expired")


def _mac(secret: str, dag_id: str, run_id: str, expires: int) -> str:
    message = "\n".join(["rollout-ledger reports", dag_id, run_id, str(expires)]).encode()
    digest = hmac.new(secret.encode(), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")
