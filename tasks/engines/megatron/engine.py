"""The Megatron-core engine: token-id prompts through megatron-core's dynamic inference engine, on one GPU.

Same contract as the vLLM engine (:class:`tasks.engines.base.Engine`): every in-flight
:meth:`MegatronEngine.generate` is one request in megatron's dynamic batch. The engine is stepped
in a thread of its own (:class:`tasks.engines.megatron.stepper.StepThread`), not on the event loop
the engine was created on, so a step never holds that loop: admissions go to the thread through a
FIFO inbox, results come back through ``loop.call_soon_threadsafe``. Only that thread touches the
megatron engine and model after :meth:`MegatronEngine.create`. Each result carries the sampled ids
(the stop token included, as vLLM does), one float32 logprob per sampled id under the
distribution it was sampled from (``processed_logprobs``; greedy rows as vLLM reports them, see
:class:`tasks.engines.megatron.model.VllmConventionSampling`), the finish reason, and the prompt it
ran on. The weights are a Hugging Face Llama folder mapped by :mod:`tasks.engines.megatron.weights`.

A refit (:meth:`MegatronEngine.update_weights`) copies the new weights into the model between two
engine steps, on the step thread. The version is bumped on the loop in the same breath as the copy
is queued, so a request admitted before it (queued ahead of the copy) carries the old version and
one admitted after it the new one. Requests in flight keep running (their KV cache so far
was computed under the old weights, as in megatron's own RL refits) and keep their admission
version; the capture layer counts them in ``epoch_span_count``.

Differences from vLLM, by megatron-core 0.19's design: the sampling generator is one per engine
(seeded by the ``seed`` option), so a request's ``seed`` does not make it reproducible alone; and
top-k and top-p cannot both be set on one request.

megatron-core is the optional extra ``megatron`` (Python >= 3.12) and needs a CUDA GPU and
flash-attn >= 2.7.3 (its dynamic attention kernels); :func:`require_megatron` and
:func:`require_gpu` say which is missing before anything starts.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.engines.base import Engine, GenerationRequest, GenerationResult, SamplingSettings, next_weight_version
from tasks.engines.megatron.options import MegatronOptions
from tasks.engines.megatron.stepper import StepThread
from tasks.engines.megatron.weights import LlamaShape, WeightMappingError, load_megatron_state, read_llama_shape
from tasks.errors import EngineDeadError, EngineError, ModelFolderError
from tasks.models.bundled import check_model_folder, load_tokenizer
from tasks.models.provenance import model_provenance

log = logging.getLogger(__name__)
EXTRA = "megatron"
GREEDY_TOP_K = 1


class MegatronUnavailableError(RuntimeError):
    """This machine cannot run the Megatron engine (the extra, a GPU or flash-attn is missing)."""


def require_megatron() -> None:
    """Raise :class:`MegatronUnavailableError` unless megatron-core can be imported here."""
    if sys.version_info < (3, 12):
        raise MegatronUnavailableError(
            f"the megatron engine needs Python >= 3.12 (megatron-core 0.19), this is "
            f"{sys.version_info.major}.{sys.version_info.minor}; use engine 'vllm' here"
        )
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise MegatronUnavailableError(
            f"megatron-core is not installed: pip install 'rollout-ledger[{EXTRA},model]' on a GPU machine"
        )


def require_gpu() -> None:
    """Raise :class:`MegatronUnavailableError` unless PyTorch sees a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        raise MegatronUnavailableError(
            "the megatron engine needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False); "
            "run it on a GPU worker, or use engine 'vllm'"
        )


@dataclass(frozen=True)
class MegatronSampling:
    """A request's sampling settings in megatron's terms (``SamplingParams`` fields)."""

    temperature: float
    top_k: int
    top_p: float


def megatron_sampling(settings: SamplingSettings) -> MegatronSampling:
    """Translate the contract's sampling settings; greedy (temperature 0) is top-k 1 at temperature 1.

    megatron takes the argmax for top-k 1 and spells "off" as top-k 0 and top-p 0.0. Refused: both
    filters on one request (megatron cannot), and top-k 1 at a temperature (it would be recorded
    as greedy; ask for temperature 0).
    """
    if settings.temperature == 0.0:
        return MegatronSampling(temperature=1.0, top_k=GREEDY_TOP_K, top_p=0.0)
    top_k = 0 if settings.top_k == -1 else settings.top_k
    top_p = 0.0 if settings.top_p == 1.0 else settings.top_p
    if top_k == GREEDY_TOP_K:
        raise EngineError("megatron engine: top_k 1 at a temperature is greedy decoding; set temperature 0 instead")
    if top_k and top_p:
        raise EngineError(f"megatron-core cannot combine top_k {top_k} with top_p {top_p} on one request")
    return MegatronSampling(temperature=float(settings.temperature), top_k=top_k, top_p=top_p)


class _TokenizerAdapter:
    """The Hugging Face tokenizer under the names megatron's controller calls (eod, bos, detokenize)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.eod = int(tokenizer.eos_token_id)
        self.bos = tokenizer.bos_token_id
        self.vocab_size = len(tokenizer)

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class MegatronEngine(Engine):
    """:class:`Engine` over ``megatron.core.inference.engines.DynamicInferenceEngine``. Create with :meth:`create`."""

    name = "megatron"

    def __init__(
        self,
        *,
        runtime: Any,
        model_path: Path,
        shape: LlamaShape,
        tokenizer: Any,
        tokenizer_sha256: str,
        options: MegatronOptions,
        max_model_len: int,
        weight_version: int,
    ) -> None:
        super().__init__(tokenizer=tokenizer, max_model_len=max_model_len, weight_version=weight_version)
        self._runtime = runtime  # megatron objects: model, engine (see _start_runtime)
        self._model_path = model_path
        self._shape = shape
        self._tokenizer_sha256 = tokenizer_sha256
        self._options = options
        self._ids = itertools.count()
        self._closed = False
        self._stepper = StepThread(
            _MegatronStepBackend(runtime.engine), asyncio.get_running_loop(), name="megatron-engine-steps"
        )

    @classmethod
    async def create(
        cls,
        model_path: str | Path,
        options: MegatronOptions | Mapping[str, Any] | None = None,
        *,
        weight_version: int = 0,
    ) -> MegatronEngine:
        """Load a checked Llama model folder onto the GPU at ``weight_version``; blocks this loop while it loads.

        The engine is bound to the running event loop: call it from that loop only.
        """
        if not isinstance(options, MegatronOptions):
            options = MegatronOptions.from_mapping(options)
        require_megatron()
        require_gpu()
        path = check_model_folder(Path(model_path))
        shape = read_llama_shape(path)
        max_model_len = options.max_model_len or shape.max_position_embeddings
        if max_model_len > shape.max_position_embeddings:
            raise ValueError(
                f"engine option max_model_len {max_model_len} exceeds the model's {shape.max_position_embeddings}"
            )
        tokenizer = load_tokenizer(path)
        runtime = _start_runtime(path, shape, options, max_model_len, tokenizer)
        return cls(
            runtime=runtime,
            model_path=path,
            shape=shape,
            tokenizer=tokenizer,
            tokenizer_sha256=model_provenance(path)["tokenizer_sha256"],
            options=options,
            max_model_len=max_model_len,
            weight_version=weight_version,
        )

    @property
    def model_path(self) -> Path:
        """The folder whose weights are loaded now."""
        return self._model_path

    @property
    def step_count(self) -> int:
        """Engine steps run so far (each one forward pass over the dynamic batch)."""
        return self._stepper.steps

    @property
    def num_unfinished_requests(self) -> int:
        """Requests and refits handed to the engine and not yet answered (running, queued, or on their way)."""
        return self._stepper.unfinished

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._check_usable(request.request_id)
        prompt = self.prompt_of(request)
        if max(prompt) >= self._shape.vocab_size or min(prompt) < 0:
            raise EngineError(f"request {request.request_id}: a prompt token is outside the vocabulary")
        from megatron.core.inference.sampling_params import SamplingParams

        sampling = megatron_sampling(request.sampling)
        params = SamplingParams(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            return_log_probs=True,
            skip_prompt_log_probs=True,
            num_tokens_to_generate=min(
                request.max_tokens or request.sampling.max_tokens, self._max_model_len - len(prompt)
            ),
            termination_id=self.eos_token_id,
        )
        try:
            record = await self._stepper.submit(_Admission(request.request_id, next(self._ids), prompt, params))
        except EngineDeadError as exc:
            raise EngineDeadError(f"request {request.request_id}: {exc}") from exc
        return to_generation_result(
            request.request_id,
            prompt,
            record.merge(),
            eos_token_id=self.eos_token_id,
        )

    async def update_weights(self, model_path: str, *, version: int | None = None) -> int:
        """Load the weights of ``model_path`` into the running model between two engine steps; return the new version.

        ``version``: see :meth:`Engine.update_weights`. ``model_path`` must carry the served
        tokenizer and the same model shape. :meth:`read_weights` then :meth:`swap_weights`.
        """
        self._check_usable("refit")
        next_weight_version(self._weight_version, version)  # refuse a bad version before reading
        return await self.swap_weights(await self.read_weights(model_path), version=version)

    async def read_weights(self, model_path: str) -> PreparedWeights:
        """Check ``model_path`` and read and map its weights off the event loop; the engine keeps stepping meanwhile."""
        self._check_usable("refit")
        try:
            path = check_model_folder(Path(model_path).expanduser().resolve())
        except ModelFolderError as exc:
            raise EngineError(f"refit to {model_path}: {exc}") from exc
        if model_provenance(path)["tokenizer_sha256"] != self._tokenizer_sha256:
            raise EngineError(f"refit to {path}: its tokenizer differs from the served one ({self._model_path})")
        try:
            shape = read_llama_shape(path)
            if shape != self._shape:
                raise WeightMappingError(f"its model shape {shape} differs from the served {self._shape}")
            state = await asyncio.to_thread(load_megatron_state, path, shape, self._runtime.dtype)
        except (WeightMappingError, OSError, KeyError) as exc:
            raise EngineError(f"refit to {path}: {exc}") from exc
        return PreparedWeights(path=path, state=state)

    async def swap_weights(self, weights: PreparedWeights, *, version: int | None = None) -> int:
        """Copy weights from :meth:`read_weights` into the model between two steps (step thread); return the version.

        The version is bumped as the copy is queued, with no await between: admissions queued
        before the copy (FIFO inbox) carry the old version, those after it the new one, and the
        requests in flight then finish under the new one (epoch spans). A failure while copying
        kills the engine: every waiter gets :class:`EngineDeadError`. A caller that stops waiting
        does not stop the copy.
        """
        from tasks.engines.megatron.model import load_weights

        self._check_usable("refit")
        new_version = next_weight_version(self._weight_version, version)
        model, path, state = self._runtime.model, weights.path, weights.state

        def copy_weights() -> None:
            try:
                load_weights(model, state)
            except Exception as exc:
                raise EngineError(f"refit to {path} failed: {type(exc).__name__}: {exc}") from exc

        copied = self._stepper.run_between_steps(copy_weights, fatal=True)
        old_version, old_path = self._weight_version, self._model_path
        self._weight_version, self._model_path = new_version, path
        try:
            await copied
        except EngineError:  # the copy failed and the engine is dead: it never served new_version
            self._weight_version, self._model_path = old_version, old_path
            raise
        return new_version

    async def close(self) -> None:
        """Stop stepping, fail the requests still inside, and free the GPU memory; idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._stepper.close()
        self._runtime = _ClosedRuntime()
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise EngineDeadError(f"request {what}: the engine is closed")
        failure = self._stepper.failure
        if failure is not None:
            raise EngineDeadError(f"request {what}: {failure}")


@dataclass(frozen=True)
class PreparedWeights:
    """A model folder's weights, checked and mapped to megatron's layout, for :meth:`MegatronEngine.swap_weights`."""

    path: Path
    state: Mapping[str, Any]


@dataclass(frozen=True)
class _Admission:
    """One request on its way to the step thread."""

    request_id: str
    megatron_id: int
    prompt: list[int]
    params: Any  # megatron SamplingParams


class _MegatronStepBackend:
    """:class:`~tasks.engines.megatron.stepper.StepBackend` over a ``DynamicInferenceEngine``, on its step thread.

    The thread gets a private event loop for megatron's coroutine steps, and the engine is pointed
    at it (``engine._loop``): the request futures megatron creates and resolves then belong to the
    thread, never to the caller's loop.
    """

    def __init__(self, engine: Any, device: int = 0) -> None:
        self._engine = engine
        self._device = device
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self) -> None:
        import torch

        torch.cuda.set_device(self._device)  # the current device is per thread
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._engine._loop = self._loop

    def admit(self, payload: _Admission) -> Any:
        try:
            return self._engine.add_request(payload.megatron_id, payload.prompt, payload.params)
        except Exception as exc:
            raise EngineError(
                f"request {payload.request_id}: megatron refused it: {type(exc).__name__}: {exc}"
            ) from exc

    def has_unfinished(self) -> bool:
        return bool(self._engine.has_unfinished_requests())

    def step(self) -> None:
        assert self._loop is not None
        self._loop.run_until_complete(self._engine.async_step())

    def shut(self) -> None:
        if self._loop is None:
            return
        pending = asyncio.all_tasks(self._loop)  # megatron's condition notifications
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()


@dataclass(frozen=True)
class _Runtime:
    """The megatron objects one engine owns."""

    model: Any
    engine: Any
    dtype: Any


class _ClosedRuntime:
    """Stands in for the runtime after close(): no model, no requests."""

    engine = None


def _start_runtime(
    path: Path, shape: LlamaShape, options: MegatronOptions, max_model_len: int, tokenizer: Any
) -> _Runtime:
    """Process groups, the GPT model with the folder's weights, and a dynamic engine over it (on cuda:0)."""
    import torch
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from tasks.engines.megatron import model as megatron_model

    torch.cuda.set_device(0)
    megatron_model.ensure_single_rank_groups(seed=options.seed)
    dtype = getattr(torch, options.dtype)
    model = megatron_model.build_gpt_model(shape, dtype, torch.device("cuda"), sampling_seed=options.seed)
    megatron_model.load_weights(model, load_megatron_state(path, shape, dtype))
    config = InferenceConfig(
        **{
            "max_sequence_length": max_model_len,
            "max_requests": options.max_requests,
            "buffer_size_gb": options.kv_cache_gb,
            "logprobs_mode": "processed_logprobs",
            "materialize_only_last_token_logits": True,
        }
        | options.inference_kwargs
    )
    context = DynamicInferenceContext(model.config, config)
    controller = TextGenerationController(
        inference_wrapped_model=GPTInferenceWrapper(model, context), tokenizer=_TokenizerAdapter(tokenizer)
    )
    controller._sampling = megatron_model.VllmConventionSampling(controller.sampling_rng, controller.vocab_size)
    return _Runtime(model=model, engine=DynamicInferenceEngine(controller=controller, context=context), dtype=dtype)


def to_generation_result(
    request_id: str,
    prompt: list[int],
    finished: Any,
    *,
    eos_token_id: int,
) -> GenerationResult:
    """Convert a finished megatron ``DynamicInferenceRequest`` to a :class:`GenerationResult`."""
    status = getattr(finished.status, "name", str(finished.status))
    if status != "COMPLETED":
        errors = [str(e.payload) for e in (finished.events or []) if "ERROR" in getattr(e.type, "name", "")]
        raise EngineError(f"request {request_id}: megatron ended it as {status}: {'; '.join(errors) or 'no detail'}")
    token_ids = tuple(int(t) for t in finished.generated_tokens)
    logprobs = np.asarray(finished.generated_log_probs or [], dtype=np.float32)
    if len(logprobs) != len(token_ids):
        raise EngineError(
            f"request {request_id}: megatron returned {len(logprobs)} logprobs for {len(token_ids)} tokens"
        )
    if not token_ids:
        raise EngineError(f"request {request_id}: megatron generated no token")
    return GenerationResult(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason="stop" if token_ids[-1] == eos_token_id else "length",
        text=finished.generated_text or "",
    )
