"""The vLLM engine: token-id prompts through vLLM's async engine (``AsyncLLM``), continuously batched.

Every in-flight :meth:`VllmEngine.generate` is one request in the same engine, so the
scheduler batches all of them. Logprobs are ``processed_logprobs`` (after temperature,
top-p and top-k: the distribution the token was sampled from), one per sampled token,
float32. A call that truncates (top-p, top-k) also returns each sampled token's kept set: vLLM's own
sampling mask where ``return_sampling_mask`` is on, else read from the top logprobs
(:mod:`tasks.engines.sampling_masks`). A refit (:meth:`VllmEngine.update_weights`) freezes the running requests, reloads
the weights in place in the workers, drops every cached KV block (running requests recompute
theirs under the new weights) and resumes: in-flight requests keep running, and the version
is bumped while nothing runs, so a request admitted under version ``v`` ran its first step on
``v``'s weights. The engine is bound to the event loop it was created on; sync callers drive
it through :class:`tasks.engines.background.BackgroundLoop`. The engine's processes end with
the process that created it, even one killed with SIGKILL (:mod:`tasks.engines.reaper`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from tasks.engines.base import FINISH_REASONS, Engine, GenerationRequest, GenerationResult, next_weight_version
from tasks.engines.options import DEFAULT_MASK_CANDIDATES
from tasks.engines.reaper import Reaper
from tasks.engines.sampling_masks import candidates_to_ask, kept_from_candidates, kept_from_engine_mask
from tasks.engines.vllm.options import VllmOptions
from tasks.env_vars import scoped_environ
from tasks.errors import EngineDeadError, EngineError, ModelFolderError
from tasks.models.bundled import check_model_folder, load_tokenizer
from tasks.models.provenance import model_provenance

log = logging.getLogger(__name__)
ENGINE_EXIT_GRACE_SECONDS = 10.0
ENGINE_PROCESS_PREFIX = "VLLM"


class VllmEngine(Engine):
    """:class:`Engine` over ``vllm.v1.engine.async_llm.AsyncLLM``. Create with :meth:`create`."""

    name = "vllm"

    def __init__(
        self,
        llm: Any,
        model_path: Path,
        tokenizer: Any,
        tokenizer_sha256: str,
        *,
        weight_version: int = 0,
        mask_candidates: int = DEFAULT_MASK_CANDIDATES,
    ) -> None:
        super().__init__(
            tokenizer=tokenizer, max_model_len=llm.model_config.max_model_len, weight_version=weight_version
        )
        self._llm = llm
        self._mask_candidates = mask_candidates
        # vLLM returns the kept sets itself (return_sampling_mask): no top logprobs to read them from
        self._engine_masks = bool(getattr(llm.model_config, "return_sampling_mask", False))
        self._model_path = model_path
        self._tokenizer_sha256 = tokenizer_sha256
        self._refit_lock = asyncio.Lock()
        self._failed: str | None = None
        self._closed = False
        self._processes: list[psutil.Process] = []  # the engine's own processes, started by create()
        self._reaper: Reaper | None = None  # stops them if this process is killed before close()

    @classmethod
    async def create(
        cls, model_path: str | Path, options: VllmOptions | Mapping[str, Any] | None = None, *, weight_version: int = 0
    ) -> VllmEngine:
        """Start an engine on a checked local model folder at ``weight_version``; blocks this loop while it starts.

        The engine is bound to the running event loop: call it from that loop only. vLLM-CPU's
        environment settings (:meth:`VllmOptions.cpu_env_defaults`) are set only while the engine processes
        start, then the process environment is restored (workers are long-lived). The watchdog
        (:class:`~tasks.engines.reaper.Reaper`) is up before the first engine process starts: a
        kill of this process at any moment of start-up, or a failed start, leaves none behind.
        """
        if not isinstance(options, VllmOptions):
            options = VllmOptions.from_mapping(options)
        path = check_model_folder(Path(model_path))
        tokenizer, tokenizer_sha256 = load_tokenizer(path), model_provenance(path)["tokenizer_sha256"]
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**options.engine_args(path, on_cpu=on_cpu))
        before = {p.pid for p in engine_processes()}
        reaper = Reaper.start()
        try:
            with scoped_environ(**(options.cpu_env_defaults(os.environ) if on_cpu else {})):
                # No local holds the AsyncLLM: a module vLLM imports lazily keeps this frame alive, and a
                # local here would keep the engine alive past close() (its __del__ then fails at exit).
                engine = cls(
                    AsyncLLM.from_engine_args(args),
                    path,
                    tokenizer,
                    tokenizer_sha256,
                    weight_version=weight_version,
                    mask_candidates=options.sampling_mask_candidates,
                )
        except BaseException:
            reaper.reap()
            raise
        reaper.started()
        engine._processes = [p for p in engine_processes() if p.pid not in before]
        engine._reaper = reaper
        return engine

    @property
    def num_unfinished_requests(self) -> int:
        """Requests inside the engine now (running or waiting in its scheduler)."""
        return 0 if self._llm is None else int(self._llm.get_num_unfinished_requests())

    @property
    def model_path(self) -> Path:
        """The folder whose weights are loaded now."""
        return self._model_path

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._check_usable(request.request_id)
        prompt = self.prompt_of(request)
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sampling = request.sampling
        asked = 0 if self._engine_masks else candidates_to_ask(sampling, self._mask_candidates)
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=request.max_tokens or sampling.max_tokens,
            seed=request.seed,
            logprobs=asked,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        try:
            async for output in self._llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request.request_id):
                final = output
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            message = f"request {request.request_id}: vLLM failed: {type(exc).__name__}: {exc}"
            if _is_dead(exc) or self._llm is None or self._llm.errored:
                raise EngineDeadError(message) from exc
            raise EngineError(message) from exc
        if final is None or not final.outputs:
            raise EngineError(f"request {request.request_id}: vLLM returned no output")
        return to_generation_result(request.request_id, final, masks=sampling.truncates, asked=asked)

    async def update_weights(self, model_path: str, *, version: int | None = None) -> int:
        """Reload the weights of ``model_path`` into the running engine; return the new version.

        ``version``: see :meth:`Engine.update_weights`.
        ``model_path`` must carry the tokenizer now served (a refit changes weights only). On a
        failed reload the engine refuses further requests: its weights are in an unknown state.
        """
        self._check_usable("refit")
        new_version = next_weight_version(self._weight_version, version)
        try:
            path = check_model_folder(Path(model_path).expanduser().resolve())
        except ModelFolderError as exc:
            raise EngineError(f"refit to {model_path}: {exc}") from exc
        if model_provenance(path)["tokenizer_sha256"] != self._tokenizer_sha256:
            raise EngineError(f"refit to {path}: its tokenizer differs from the served one ({self._model_path})")
        async with self._refit_lock:
            await self._llm.pause_generation(mode="keep", clear_cache=True)
            try:
                self._weight_version = new_version
                await self._llm.collective_rpc(
                    "reload_weights", kwargs={"weights_path": str(path), "is_checkpoint_format": True}
                )
                await self._llm.reset_prefix_cache(reset_running_requests=True)
            except Exception as exc:
                self._failed = f"refit to {path} failed: {type(exc).__name__}: {exc}"
                raise EngineError(self._failed) from exc
            finally:
                await self._llm.resume_generation()
            self._model_path = path
            return self._weight_version

    async def close(self) -> None:
        """Shut down the engine and make sure none of its processes outlives this call; idempotent.

        vLLM's shutdown asks its processes to stop; any still running
        :data:`ENGINE_EXIT_GRACE_SECONDS` later (a busy or wedged engine core) is killed.
        """
        if self._closed:
            return
        self._closed = True
        llm, self._llm = self._llm, None
        llm.shutdown()
        del llm  # the last reference: AsyncLLM.__del__ runs now, not at interpreter teardown where it fails
        alive = await _wait_exited(self._processes, ENGINE_EXIT_GRACE_SECONDS)
        for process in alive:
            log.warning("engine process %d did not exit after shutdown: killing it", process.pid)
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        await _wait_exited(alive, ENGINE_EXIT_GRACE_SECONDS)
        if self._reaper is not None:
            self._reaper.stop()

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise EngineDeadError(f"request {what}: the engine is closed")
        if self._failed is not None:
            raise EngineDeadError(f"request {what}: {self._failed}")
        if self._llm.errored:
            raise EngineDeadError(f"request {what}: the vLLM engine core is dead")


async def _wait_exited(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` s for ``processes`` to end (a zombie has ended); return those still running."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in processes if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        await asyncio.sleep(0.1)


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def engine_processes(parent: psutil.Process | None = None) -> list[psutil.Process]:
    """Descendants of ``parent`` (this process) that vLLM started for an engine (it names them ``VLLM::...``).

    Other children (Python's multiprocessing resource tracker) live until their parent exits.
    """
    found = []
    for child in (parent or psutil.Process()).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.name().startswith(ENGINE_PROCESS_PREFIX):
                found.append(child)
    return found


def _is_dead(exc: BaseException) -> bool:
    """Whether vLLM raised because its engine core is gone (not because of this request)."""
    from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

    return isinstance(exc, VllmEngineDeadError)


def to_generation_result(request_id: str, output: Any, *, masks: bool = False, asked: int = 0) -> GenerationResult:
    """Convert a finished vLLM ``RequestOutput`` to a :class:`GenerationResult`.

    ``masks``: the call truncated, so the result carries its kept sets: vLLM's sampling mask when the
    output has one, else read from the ``asked`` top logprobs of each position (an overflow raises).
    """
    completion = output.outputs[0]
    token_ids = tuple(int(t) for t in completion.token_ids)
    positions = completion.logprobs
    if positions is None or len(positions) != len(token_ids):
        raise EngineError(
            f"request {request_id}: vLLM returned {0 if positions is None else len(positions)} logprob positions "
            f"for {len(token_ids)} tokens"
        )
    logprobs = np.fromiter(
        (positions[i][token].logprob for i, token in enumerate(token_ids)), dtype=np.float32, count=len(token_ids)
    )
    if completion.finish_reason not in FINISH_REASONS:
        raise EngineError(f"request {request_id}: vLLM finished with {completion.finish_reason!r}")
    kept = None
    if masks and getattr(completion, "sampling_mask", None) is not None:
        kept = kept_from_engine_mask(request_id, token_ids, completion.sampling_mask.token_ids)
    elif masks and asked:
        candidates = [((int(t), lp.logprob) for t, lp in position.items()) for position in positions]
        kept = kept_from_candidates(request_id, token_ids, candidates, asked)
    return GenerationResult(
        request_id=request_id,
        prompt_token_ids=tuple(int(t) for t in output.prompt_token_ids),
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        text=completion.text,
        metadata={"stop_reason": completion.stop_reason},
        kept=kept,
    )
