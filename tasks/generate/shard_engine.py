"""The engine the shards of one generate run share: :class:`ShardEngine`.

An engine passed in is used as it is and never shut down here. Otherwise the engine the batch
config names is created at the planned weight version the first time an attempt has a rollout
to run (a retry that adopts every rollout starts none), at most once per run, and shut down by
:meth:`ShardEngine.close`, which the caller reaches on every path.

An engine of replicas that cover for each other (:class:`Replicated`: ``vllm_server``) may lose
one and serve on: :meth:`ShardEngine.survives` says so, and :meth:`ShardEngine.calls_by_replica`
counts the calls each replica answered.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tasks.config import BatchConfig
from tasks.engines.base import Engine
from tasks.generate.checks import check_engine_version

log = logging.getLogger(__name__)


@runtime_checkable
class Replicated(Protocol):
    """An engine of several replicas that cover for each other."""

    def survives(self, error: BaseException) -> bool:
        """Whether it still serves after ``error``: the error lost one replica, and another lives."""
        ...

    def calls_by_replica(self) -> dict[str, int]:
        """The answers each replica gave so far, by name."""
        ...


class ShardEngine:
    """The engine the shards run on: one passed in, or the batch's own, started the first time an
    attempt has a rollout to run (a retry that adopts every rollout starts none) and shut down by
    :meth:`close`, with ``on_start(expected_seconds)`` entered before it starts and left after."""

    def __init__(
        self,
        config: BatchConfig,
        *,
        engine: Engine | None = None,
        on_start: Callable[[float], contextlib.AbstractContextManager[Any]] | None = None,
        model_folder: Path | None = None,
    ) -> None:
        self._config, self._engine, self._own = config, engine, engine is None
        self._on_start, self._model_folder = on_start, model_folder
        self._context = contextlib.ExitStack()

    async def get(self) -> Engine:
        if self._engine is None:
            self._engine = await self._start()
        return self._engine

    async def _start(self) -> Engine:
        from tasks.engines import create_engine
        from tasks.engines.startup import expected_start_seconds, record_start_seconds

        config = self._config
        if self._on_start is not None:
            self._context.enter_context(self._on_start(expected_start_seconds(config.engine.name)))
        started = time.monotonic()
        log.info("starting the %s engine on %s", config.engine.name, config.model.reference)
        engine = await create_engine(
            config.engine.name,
            model_path=self._model_folder,  # type: ignore[arg-type]
            options=config.engine.options,
            weight_version=config.weight_version,
        )
        try:
            check_engine_version(engine, config)  # a server reports its own version, maybe an older one
        except BaseException:
            await engine.close()
            raise
        record_start_seconds(config.engine.name, time.monotonic() - started)
        log.info("engine started in %.0f s", time.monotonic() - started)
        return engine

    def survives(self, error: BaseException) -> bool:
        """Whether the shards can go on after ``error`` on the engine already started (:class:`Replicated`)."""
        return isinstance(self._engine, Replicated) and self._engine.survives(error)

    def calls_by_replica(self) -> dict[str, int]:
        """The calls each replica answered so far (empty for an engine without replicas, or none started)."""
        return self._engine.calls_by_replica() if isinstance(self._engine, Replicated) else {}

    async def close(self) -> None:
        """Shut down an engine this started (one passed in stays up); leave ``on_start``'s context."""
        try:
            if self._own and self._engine is not None:
                await self._engine.close()
        finally:
            self._context.close()
