"""The ``vllm_server`` engine: the engine contract over HTTP to running vLLM servers.

This client renders and tokenizes (the capture layer does, as for every engine), sends token
ids to vLLM's token-in/token-out endpoint ``/inference/v1/generate``, and records what the
server sampled: its token ids, their ``processed_logprobs`` and the server's weight-version spans, and for
a call that truncates (top-p, top-k) each token's kept set: the server's ``sampling_mask`` where it returns
one, else read from the top logprobs it was asked for (:mod:`tasks.engines.sampling_masks`).
It never falls back to text: an answer without ids, logprobs or weight spans, with logprobs of
other tokens, or run on another prompt is a named engine error of that call. An ``abort`` finish
(the server shutting down, a pause in abort mode) is never a reply: it loses the replica
(:class:`~tasks.engines.vllm_server.replica.ReplicaDeadError`), as an unreachable, restarted or
rolled-back server does (:mod:`tasks.engines.vllm_server.replica`).

All calls of one rollout go to one replica (its prefix cache holds the rollout's history) and
carry ``X-Session-ID: <rollout id>`` (a router in front of several servers hashes on it); a new
rollout goes to the live replica with the fewest calls in flight, ties split by a hash of the
rollout id, so concurrent generate processes spread over the replicas. While one replica lives
the engine serves (:meth:`VllmServerEngine.survives`); a rollout whose replica was lost moves to
a live one. The engine starts nothing and stops nothing: :meth:`close` only closes its
connections. A refit (:meth:`VllmServerEngine.update_weights`) drives the live servers' own RL
endpoints (:func:`tasks.engines.vllm_server.refit.refit_servers`).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tasks.engines.base import (
    FINISH_REASONS,
    SERVED_BY,
    Engine,
    GenerationRequest,
    GenerationResult,
    WeightVersionSpan,
    next_weight_version,
)
from tasks.engines.options import DEFAULT_MASK_CANDIDATES
from tasks.engines.sampling_masks import candidates_to_ask, kept_from_candidates, kept_from_engine_mask
from tasks.engines.vllm_server.claims import parse_weight_version, read_claims, replicas_of
from tasks.engines.vllm_server.options import VllmServerOptions
from tasks.engines.vllm_server.refit import refit_servers
from tasks.engines.vllm_server.replica import ReplicaDeadError, ServerReplica
from tasks.engines.vllm_server.weights import ServedWeights
from tasks.errors import ConfigError, EngineDeadError, EngineError
from tasks.models.bundled import check_model_folder, load_tokenizer

GENERATE_PATH = "/inference/v1/generate"
ABORT = "abort"  # a finish that cuts a reply: the server is going away or pausing, not done
# Rollouts whose replica is remembered; older ones may move (losing only their prefix cache).
MAX_PINNED_SESSIONS = 65536


class VllmServerEngine(Engine):
    """:class:`Engine` over one or more ``vllm serve`` replicas. Create with :meth:`create`."""

    name = "vllm_server"

    def __init__(
        self,
        replicas: list[ServerReplica],
        *,
        served_model: str,
        weights: str,
        tokenizer: Any,
        max_model_len: int,
        weight_version: int,
        served_weights: ServedWeights | None = None,
        mask_candidates: int = DEFAULT_MASK_CANDIDATES,
    ) -> None:
        super().__init__(tokenizer=tokenizer, max_model_len=max_model_len, weight_version=weight_version)
        self.replicas = replicas
        self._mask_candidates = mask_candidates
        self.served_model = served_model
        self.weights = weights
        # names each call's weights from the servers' records (none given: from no server's)
        self._served_weights = served_weights or ServedWeights(set(), since=weight_version)
        self._sessions: collections.OrderedDict[str, ServerReplica] = collections.OrderedDict()
        self._turns = itertools.count()  # splits ties of calls without a session
        self._closed = False

    @classmethod
    async def create(
        cls,
        model_path: str | Path,
        options: VllmServerOptions | Mapping[str, Any] | None = None,
        *,
        weight_version: int = 0,
    ) -> VllmServerEngine:
        """Connect to the servers of ``options`` and check what they serve before any call.

        ``model_path`` is this worker's copy of the planned model (its tokenizer renders the
        prompts). Refused: a server that serves another model (:class:`~tasks.errors.ModelMismatchError`),
        replicas that disagree, a logprobs mode other than processed, a refused API key. The
        engine's weight version is the servers' own; generate refuses it when it is below the plan's.
        ``weight_version`` is the plan's: servers at that version must serve the planned weights
        (:meth:`ServedWeights.connect`).
        """
        if not isinstance(options, VllmServerOptions):
            options = VllmServerOptions.from_mapping(options)
        path = check_model_folder(Path(model_path))
        replicas = replicas_of(options)
        try:
            claims = await read_claims(replicas)
            claim = claims[0]  # they agree
            if options.max_model_len is not None and options.max_model_len > claim.max_model_len:
                raise ConfigError(
                    f"engine option max_model_len {options.max_model_len} exceeds the {claim.max_model_len} "
                    f"tokens the servers accept"
                )
            weights, served = await ServedWeights.connect(
                replicas, claims, path, options.served_model, planned_version=weight_version
            )
            tokenizer = await asyncio.to_thread(load_tokenizer, path)
        except BaseException:
            await asyncio.gather(*(replica.close() for replica in replicas))
            raise
        for replica, known in zip(replicas, claims, strict=True):
            replica.identity, replica.weight_version = known.identity, known.weight_version
        return cls(
            replicas,
            served_model=claim.model,
            weights=weights,
            tokenizer=tokenizer,
            max_model_len=options.max_model_len or claim.max_model_len,
            weight_version=claim.weight_version,
            served_weights=served,
            mask_candidates=options.sampling_mask_candidates,
        )

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    def survives(self, error: BaseException) -> bool:
        """Whether the engine still serves after ``error``: it lost one of its replicas, and another lives."""
        lost = isinstance(error, ReplicaDeadError) and error.url in self.urls
        return lost and not self._closed and any(replica.lost is None for replica in self.replicas)

    def calls_by_replica(self) -> dict[str, int]:
        """The answers taken from each replica so far, by URL."""
        return {replica.url: replica.answered for replica in self.replicas}

    def _replica_for(self, session_id: str | None) -> ServerReplica:
        """The live replica of ``session_id``'s earlier calls, else the live one with the fewest calls in flight.

        Ties go by a hash of ``session_id`` (in turn without one), never always to the first.
        """
        pinned = self._sessions.get(session_id) if session_id is not None else None
        if pinned is not None and pinned.lost is None:
            self._sessions.move_to_end(session_id)  # type: ignore[arg-type]
            return pinned
        live = [replica for replica in self.replicas if replica.lost is None]
        if not live:
            reasons = "; ".join(str(replica.lost) for replica in self.replicas)
            raise EngineDeadError(f"every server is lost: {reasons}")
        fewest = min(replica.in_flight for replica in live)
        tied = [replica for replica in live if replica.in_flight == fewest]
        replica = tied[tie_break(session_id, next(self._turns)) % len(tied)]
        if session_id is not None:
            self._sessions[session_id] = replica
            self._sessions.move_to_end(session_id)
            if len(self._sessions) > MAX_PINNED_SESSIONS:
                self._sessions.popitem(last=False)
        return replica

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._closed:
            raise EngineDeadError(f"request {request.request_id}: the engine is closed")
        prompt = self.prompt_of(request)
        sampling = request.sampling
        asked = candidates_to_ask(sampling, self._mask_candidates)
        body = {
            "request_id": request.request_id,
            "model": self.served_model,
            "token_ids": prompt,
            "return_token_ids": True,
            "sampling_params": {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "max_tokens": request.max_tokens or sampling.max_tokens,
                "seed": request.seed,
                "logprobs": asked,
            },
        }
        replica = self._replica_for(request.session_id)
        answer, sent_version = await replica.generate(GENERATE_PATH, body, request.session_id)
        try:
            result = parse_generate_answer(
                request.request_id, answer, replica.url, self._tokenizer, masks=sampling.truncates, asked=asked
            )
        except ReplicaDeadError as error:
            raise replica.lose(error) from None
        replica.accept(result.weight_spans, sent_version, request.request_id)
        self._weight_version = max(r.weight_version for r in self.replicas if r.lost is None)
        return await self._served_weights.stamp(result, replica)

    async def update_weights(self, model_path: str, *, version: int | None = None) -> int:
        """Load ``model_path`` (a folder as the servers see it) into every replica; return the new version.

        Calls admitted before the switch keep running and their spans say which tokens each
        version sampled. ``version``: see :meth:`Engine.update_weights`.
        """
        if self._closed:
            raise EngineDeadError("refit: the engine is closed")
        new_version = next_weight_version(self._weight_version, version)
        live = [replica for replica in self.replicas if replica.lost is None]
        if not live:
            raise EngineDeadError(f"refit to {model_path}: every server is lost")
        await refit_servers(live, model_path, new_version)
        for replica in live:
            replica.weight_version = new_version
        self._weight_version = new_version
        return new_version

    async def close(self) -> None:
        """Close the connections (the servers keep running); idempotent."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(replica.close() for replica in self.replicas))


def parse_generate_answer(
    request_id: str, answer: Any, url: str, tokenizer: Any, *, masks: bool = False, asked: int = 0
) -> GenerationResult:
    """The result a ``/inference/v1/generate`` answer holds; an :class:`EngineError` naming what it lacks.

    ``masks``: the call truncated, so the result carries its kept sets: the answer's ``sampling_mask`` when it
    has one, else read from the ``asked`` top logprobs of each position (an overflow raises).
    """

    def fail(what: str) -> EngineError:
        return EngineError(f"request {request_id}: server {url} {what}")

    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise fail(f"answered without exactly one choice: {str(answer)[:200]}")
    choice = choices[0]
    token_ids = choice.get("token_ids")
    if choice.get("finish_reason") == ABORT:  # whatever else it holds: a cut reply is never a completed one
        cut = len(token_ids) if isinstance(token_ids, list) else 0
        raise ReplicaDeadError(
            url,
            f"request {request_id}: server {url} aborted it after {cut} tokens (it is shutting down, or paused in "
            "abort mode): a cut reply, never a completed one",
        )
    if not _int_list(token_ids):
        raise fail("answered without token ids (it must run the token-in/token-out endpoint with token output)")
    prompt_ids = answer.get("prompt_token_ids")
    if not _int_list(prompt_ids):
        raise fail("answered without the prompt's token ids")
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list) or len(content) != len(token_ids):
        count = len(content) if isinstance(content, list) else 0
        raise fail(f"answered {count} logprobs for {len(token_ids)} tokens")
    logprobs = np.empty(len(token_ids), dtype=np.float32)
    for position, (token, entry) in enumerate(zip(token_ids, content, strict=True)):
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("token_id") != token:
            raise fail(f"answered the logprob of another token at position {position}")
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value > 0:
            raise fail(f"answered logprob {value!r} at position {position}")
        logprobs[position] = value
    finish_reason = choice.get("finish_reason")
    if finish_reason not in FINISH_REASONS:
        raise fail(f"finished with {finish_reason!r}")
    kept = None
    if masks and choice.get("sampling_mask") is not None:
        mask = choice["sampling_mask"]
        if not isinstance(mask, list) or not all(_int_list(kept_ids) for kept_ids in mask):
            raise fail("answered a sampling mask that is not a list of token id lists")
        kept = kept_from_engine_mask(request_id, token_ids, mask)
    elif masks and asked:
        kept = kept_from_candidates(request_id, token_ids, [_candidates(entry, fail) for entry in content], asked)
    return GenerationResult(
        request_id=request_id,
        prompt_token_ids=tuple(prompt_ids),
        token_ids=tuple(token_ids),
        logprobs=logprobs,
        finish_reason=finish_reason,
        text=tokenizer.decode(token_ids, skip_special_tokens=True),
        response_id=answer.get("request_id"),
        metadata={"stop_reason": choice.get("stop_reason"), SERVED_BY: url},
        weight_spans=_weight_spans(choice.get("weight_versions"), len(token_ids), url, fail),
        kept=kept,
    )


def _candidates(entry: dict[str, Any], fail: Any) -> list[tuple[int, float]]:
    """One position's top (token id, logprob) candidates, as the server listed them."""
    top = entry.get("top_logprobs")
    if not isinstance(top, list) or not all(isinstance(item, dict) for item in top):
        raise fail(f"answered top logprobs {str(top)[:100]} that are not a list of candidates")
    found = [(item.get("token_id"), item.get("logprob")) for item in top]
    if not all(
        _int_list([token]) and isinstance(value, int | float) and not isinstance(value, bool) for token, value in found
    ):
        raise fail("answered a top logprob candidate without an int token id and a number")
    return found


def _weight_spans(spans: Any, tokens: int, url: str, fail: Any) -> tuple[WeightVersionSpan, ...]:
    """The server's spans as ints, checked to cover ``[0, tokens)`` in order; at least one is required."""
    if not spans:
        raise fail(
            f"answered {tokens} tokens without weight-version spans (every answer must say which version sampled it)"
        )
    if not isinstance(spans, list) or not all(isinstance(span, dict) for span in spans):
        raise fail(f"answered malformed weight spans {spans!r}")
    try:
        parsed = tuple(
            WeightVersionSpan(parse_weight_version(span.get("version"), url), span.get("start"), span.get("end"))
            for span in spans
        )
    except EngineError as exc:
        raise fail(f"answered a span whose {exc}") from None
    position = 0
    for span in parsed:
        if not _int_list([span.start, span.end]) or span.start != position or span.end <= span.start:
            raise fail(f"answered weight spans {spans!r} that do not cover its {tokens} tokens in order")
        position = span.end
    if position != tokens:
        raise fail(f"answered weight spans {spans!r} that do not cover its {tokens} tokens in order")
    return parsed


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def tie_break(session_id: str | None, turn: int) -> int:
    """A number that splits ties between replicas: a stable hash of ``session_id``, else ``turn``."""
    if session_id is None:
        return turn
    return int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big")
