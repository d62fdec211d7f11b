"""The step thread's backend over megatron-core's ``DynamicInferenceEngine``.

Invariant: megatron's request futures are created and resolved on the step thread's private
event loop (``engine._loop`` points at it), never on the loop that awaits the results; only the
step thread calls into this backend (:class:`~tasks.engines.megatron.stepper.StepThread`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tasks.errors import EngineError

if TYPE_CHECKING:
    from tasks.engines.megatron.kept import KeptRecorder


@dataclass(frozen=True)
class Admission:
    """One request on its way to the step thread."""

    request_id: str
    megatron_id: int
    prompt: list[int]
    params: Any  # megatron SamplingParams


class MegatronStepBackend:
    """:class:`~tasks.engines.megatron.stepper.StepBackend` over a ``DynamicInferenceEngine``, on its step thread.

    The thread gets a private event loop for megatron's coroutine steps, and the engine is pointed
    at it (``engine._loop``): the request futures megatron creates and resolves then belong to the
    thread, never to the caller's loop.
    """

    def __init__(self, engine: Any, device: int = 0, kept: KeptRecorder | None = None) -> None:
        self._engine = engine
        self._device = device
        self._kept = kept
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self) -> None:
        """Select the GPU for this thread and give it a private event loop that megatron's engine uses."""
        import torch

        torch.cuda.set_device(self._device)  # the current device is per thread
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._engine._loop = self._loop

    def admit(self, payload: Admission) -> Any:
        """Add the request to megatron's dynamic batch; its refusal is this request's :class:`EngineError`."""
        try:
            return self._engine.add_request(payload.megatron_id, payload.prompt, payload.params)
        except Exception as exc:
            raise EngineError(
                f"request {payload.request_id}: megatron refused it: {type(exc).__name__}: {exc}"
            ) from exc

    def has_unfinished(self) -> bool:
        """Whether megatron holds requests not yet finished."""
        return bool(self._engine.has_unfinished_requests())

    def step(self) -> None:
        """Run one engine step on the thread's loop, then file the kept sets its sampler staged (before the step
        thread hands back the requests it finished)."""
        assert self._loop is not None
        self._loop.run_until_complete(self._engine.async_step())
        if self._kept is not None:
            self._kept.record()

    def shut(self) -> None:
        """Cancel what megatron left on the thread's loop and close it."""
        if self._loop is None:
            return
        pending = asyncio.all_tasks(self._loop)  # megatron's condition notifications
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()
