"""The ``vllm_server`` engine's options (``engine.options`` of a batch config for ``engine: vllm_server``).

Light on purpose (pydantic and the standard library only): the engine registry imports it to
check options at plan time and to describe them in the Airflow form. No option holds a secret:
the bearer token is read at run time from ``api_key_file`` or from :data:`API_KEY_ENV` (where
Airflow puts a connection's password), so it never reaches the batch config.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from tasks.engines.options import DEFAULT_MASK_CANDIDATES, MAX_MASK_CANDIDATES, EngineOptions, read_key_file

# Where a generate task finds the servers' API key when no key file is named (set from an Airflow connection),
# and where that key came from, in words, for messages (never the key).
API_KEY_ENV = "ROLLOUT_LEDGER_SERVER_API_KEY"
API_KEY_SOURCE_ENV = "ROLLOUT_LEDGER_SERVER_API_KEY_SOURCE"

# How long each of a refit's calls may take; loading the weights, the long one, takes minutes for a large model.
# The refit pauses the calls in flight meanwhile, so no model call times out sooner.
REFIT_TIMEOUT_SECONDS = 1800.0
# A call's default time-out: a whole refit pause plus the call's own generation time.
DEFAULT_REQUEST_TIMEOUT_SECONDS = REFIT_TIMEOUT_SECONDS + 600.0


class VllmServerOptions(EngineOptions):
    """Options of ``engine: vllm_server``: the replicas to call and how to authenticate.

    Each URL is one running ``vllm serve`` (started with the RL endpoints on; ``rollout-ledger
    serve`` does), or a router in front of several. Every rollout stays on one replica and names
    itself in ``X-Session-ID``; new rollouts go to the least loaded live one; a lost replica's
    rollouts move to another (docs/servers.md, "Several replicas").
    """

    engine = "vllm_server"

    urls: list[str] = Field(min_length=1, description="Base URLs of the vLLM servers, e.g. http://127.0.0.1:8000.")
    api_key_file: str | None = Field(
        None, description=f"File holding the servers' API key; default the {API_KEY_ENV} variable, else no key."
    )
    served_model: str | None = Field(
        None,
        description="Model name the servers must serve when their weights are not on this machine "
        "(then recorded as declared, not verified).",
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt + generation of one call; default the servers' own (at most it)."
    )
    request_timeout_s: float = Field(
        DEFAULT_REQUEST_TIMEOUT_SECONDS,
        gt=0,
        allow_inf_nan=False,
        description=f"Seconds one model call may take before it fails; a value below a refit pause "
        f"({REFIT_TIMEOUT_SECONDS:g} s, which holds the calls in flight) is raised to it.",
    )

    sampling_mask_candidates: int = Field(
        DEFAULT_MASK_CANDIDATES,
        ge=0,
        le=MAX_MASK_CANDIDATES,
        description="Top logprobs asked per token of a top-p / top-k call to record the ids its sampler kept (at "
        "most the servers' max_logprobs); a token that kept this many or more fails its call "
        "(sampling_mask_overflow). 0: the servers return vLLM's own mask (return_sampling_mask on).",
    )

    @field_validator("request_timeout_s")
    @classmethod
    def _outlasts_a_refit(cls, seconds: float) -> float:
        """Raised, not refused: a batch config is read again by every later stage and must stay readable."""
        return max(seconds, REFIT_TIMEOUT_SECONDS)

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            parts = urlsplit(url)
            if "@" in parts.netloc:  # never echo it: the userinfo may be a password
                shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
                raise ValueError(
                    f"engine option urls: the URL of {shown!r} carries credentials (user:password@); give the "
                    "servers' key with api_key_file or the connection's password, never in a URL"
                )
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"engine option urls: {url!r} is not an http(s) URL with a host")
            if parts.query or parts.fragment:
                raise ValueError(f"engine option urls: {url!r} has a query or fragment; give the server's base URL")
        bases = [url.rstrip("/") for url in urls]
        if len(set(bases)) != len(bases):
            raise ValueError(f"engine option urls names a server twice: {urls}")
        return bases

    def api_key(self) -> str | None:
        """The bearer token: the key file's first line, else :data:`API_KEY_ENV`, else ``None`` (no auth)."""
        if self.api_key_file is not None:
            return read_key_file(self.api_key_file, what="engine option api_key_file")
        return os.environ.get(API_KEY_ENV) or None

    def key_source(self) -> str:
        """Where the key comes from, in words (for messages: never the key itself)."""
        if self.api_key_file is not None:
            return f"the key in {self.api_key_file}"
        if os.environ.get(API_KEY_ENV):
            return os.environ.get(API_KEY_SOURCE_ENV) or f"${API_KEY_ENV}"
        return "no API key"
