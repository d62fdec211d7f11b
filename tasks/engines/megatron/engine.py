"""The Megatron-core engine: token-id prompts through megatron-core's dynamic inference engine, on one GPU.

Same contract as the vLLM engine (:class:`tasks.engines.base.Engine`): every in-flight
:meth:`MegatronEngine.generate` is one request in megatron's dynamic batch. The engine is stepped
in a thread of its own (:class:`tasks.engines.megatron.stepper.StepThread` over
:class:`tasks.engines.megatron.step_backend.MegatronStepBackend`), not on the event loop the
engine was created on, so a step never holds that loop: admissions go to the thread through a
FIFO inbox, results come back through ``loop.call_soon_threadsafe``. Only that thread touches the
megatron engine and model after :meth:`MegatronEngine.create`. Each result carries the sampled ids
(the stop token included, as vLLM does), one float32 logprob per sampled id under the
distribution it was sampled from (``processed_logprobs``; greedy rows as vLLM reports them, see
:class:`tasks.engines.megatron.model.VllmConventionSampling`), the finish reason, and the prompt it
ran on. A call that truncates (top-k or top-p) also carries each sampled token's kept set: the ids
megatron's sampler kept, read from the very mask it drew the token from
(:class:`tasks.engines.megatron.model.VllmConventionSampling`, :mod:`tasks.engines.megatron.kept`).
The weights are a Hugging Face Llama folder mapped by :mod:`tasks.engines.megatron.weights`.

A refit (:meth:`MegatronEngine.update_weights`) copies the new weights into the model between two
engine steps, on the step thread. The version is bumped on the loop in the same breath as the copy
is queued, so a request admitted before it (queued ahead of the copy) carries the old version and
one admitted after it the new one. Requests in flight keep running (their KV cache so far
was computed under the old weights, as in megatron's own RL refits) and keep their admission
version; the capture layer counts them in ``epoch_span_count``.

Differences from vLLM, by megatron-core 0.19's design: the sampling generator is one per engine
(seeded by the ``seed`` option), so a request's ``seed`` does not make it reproducible alone; and
top-k and top-p cannot both be set on one request (:mod:`tasks.engines.megatron.sampling`).

megatron-core is the optional extra ``megatron`` (Python >= 3.12) and needs a CUDA GPU and
flash-attn >= 2.7.3 (its dynamic attention kernels); :mod:`tasks.engines.megatron.availability`
says which is missing before anything starts.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.engines.base import Engine, GenerationRequest, GenerationResult, next_weight_version
from tasks.engines.megatron.availability import require_gpu, require_megatron
from tasks.engines.megatron.options import MegatronOptions
from tasks.engines.megatron.results import to_generation_result
from tasks.engines.megatron.runtime import ClosedRuntime, Runtime, start_runtime
from tasks.engines.megatron.sampling import megatron_sampling
from tasks.engines.megatron.step_backend import Admission, MegatronStepBackend
from tasks.engines.megatron.stepper import StepThread
from tasks.engines.megatron.weights import LlamaShape, WeightMappingError, load_megatron_state, read_llama_shape
from tasks.errors import EngineDeadError, EngineError, ModelFolderError
from tasks.models.bundled import check_model_folder, load_tokenizer
from tasks.models.provenance import model_provenance


class MegatronEngine(Engine):
    """:class:`Engine` over ``megatron.core.inference.engines.DynamicInferenceEngine``. Create with :meth:`create`."""

    name = "megatron"

    def __init__(
        self,
        *,
        runtime: Runtime,
        model_path: Path,
        shape: LlamaShape,
        tokenizer: Any,
        tokenizer_sha256: str,
        options: MegatronOptions,
        max_model_len: int,
        weight_version: int,
    ) -> None:
        super().__init__(tokenizer=tokenizer, max_model_len=max_model_len, weight_version=weight_version)
        self._runtime = runtime  # megatron objects: model, engine (see start_runtime)
        self._model_path = model_path
        self._shape = shape
        self._tokenizer_sha256 = tokenizer_sha256
        self._options = options
        self._ids = itertools.count()
        self._closed = False
        self._kept = runtime.kept  # the sampler's kept sets, by megatron request id
        self._stepper = StepThread(
            MegatronStepBackend(runtime.engine, kept=runtime.kept),
            asyncio.get_running_loop(),
            name="megatron-engine-steps",
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
        runtime = start_runtime(path, shape, options, max_model_len, tokenizer)
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
        megatron_id = next(self._ids)
        if request.sampling.truncates:
            self._kept.expect(megatron_id)
        try:
            record = await self._stepper.submit(Admission(request.request_id, megatron_id, prompt, params))
        except EngineDeadError as exc:
            raise EngineDeadError(f"request {request.request_id}: {exc}") from exc
        finally:
            kept = self._kept.take(megatron_id)  # complete once megatron finished it; forgotten if it failed
        return to_generation_result(
            request.request_id,
            prompt,
            record.merge(),
            eos_token_id=self.eos_token_id,
            kept=kept,
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
        self._runtime = ClosedRuntime()
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
