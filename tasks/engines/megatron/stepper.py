"""Step an in-process inference engine in its own thread, off the event loop that awaits its results.

megatron-core's dynamic engine runs in the caller's process. Stepped on the event loop, each step
holds that loop for its whole duration, so every other coroutine on it (the capture layer's
round-trips through threads, the environments) waits for the step in progress to end, and a
rollout's slot in the batch stays empty meanwhile. :class:`StepThread` runs the step loop in a
thread of its own instead (a step is mostly CUDA work, which releases the GIL) and hands work
across in both directions:

- loop → thread: admissions (:meth:`StepThread.submit`) and between-step actions
  (:meth:`StepThread.run_between_steps`, e.g. a refit) go into one FIFO inbox under a lock;
- thread → loop: results and errors reach the awaiting :class:`asyncio.Future` through
  ``loop.call_soon_threadsafe``, one batch per step.

Invariants:

1. Only the step thread touches the backend (:class:`StepBackend`): admission, stepping and
   between-step actions are never concurrent with a step.
2. The inbox is applied in FIFO order, before the next step: a between-step action runs after
   every admission submitted before it and before any submitted after it.
3. Every waiter is settled exactly once: with its result, its own error, or
   :class:`~tasks.errors.EngineDeadError` when the thread fails (an exception escaping a
   step, or a fatal between-step action) or is closed. After either, :meth:`StepThread.submit`
   refuses at once; the lock makes "refuse" and "fail what is queued" one decision, so no waiter
   is left behind.
4. :meth:`StepThread.close` joins the thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from tasks.errors import EngineDeadError, EngineError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Outcome(Protocol):
    """A request's completion as the backend reports it (``asyncio.Future`` or ``concurrent.futures.Future``)."""

    def done(self) -> bool: ...

    def result(self) -> Any: ...


class StepBackend(Protocol):
    """What the step thread drives; every method is called on the step thread only."""

    def open(self) -> None:
        """Prepare the thread (device, private event loop); called once, first."""

    def admit(self, payload: Any) -> Outcome:
        """Queue one request; raise :class:`EngineError` to refuse it alone."""

    def has_unfinished(self) -> bool:
        """Whether a step would have work to do."""

    def step(self) -> None:
        """Run one engine step; an exception kills the engine."""

    def shut(self) -> None:
        """Release what :meth:`open` took; called once, last, even after a failure."""


@dataclass
class _Admission:
    payload: Any
    waiter: asyncio.Future[Any]


@dataclass
class _BetweenSteps:
    action: Callable[[], Any]
    waiter: asyncio.Future[Any]
    fatal: bool


class _Stop:
    """Inbox marker: stop after what is ahead of it."""


_Item = _Admission | _BetweenSteps | _Stop
# (waiter, result, error): what the loop sets on one waiter.
_Settlement = tuple[asyncio.Future[Any], Any, BaseException | None]
CLOSED = "the engine was closed"


class StepThread:
    """Runs ``backend`` in a daemon thread; created and used from the event loop ``loop``."""

    def __init__(self, backend: StepBackend, loop: asyncio.AbstractEventLoop, *, name: str) -> None:
        self._backend = backend
        self._loop = loop
        self._name = name
        self._wake = threading.Condition(threading.Lock())
        self._inbox: deque[_Item] = deque()  # guarded by _wake
        self._failure: str | None = None  # guarded by _wake; set once
        self._closing = False  # guarded by _wake
        self._steps = 0  # written by the thread only
        self._in_flight: list[tuple[Outcome, asyncio.Future[Any]]] = []  # the thread's own
        self._open: set[asyncio.Future[Any]] = set()  # the loop's own: waiters not yet settled
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- the loop's side -------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Engine steps run so far."""
        return self._steps

    @property
    def failure(self) -> str | None:
        """Why the thread stopped serving (a failure or close), or None while it serves."""
        with self._wake:
            return self._failure

    @property
    def unfinished(self) -> int:
        """Admissions and between-step actions submitted and not yet settled."""
        return len(self._open)

    def submit(self, payload: Any) -> asyncio.Future[Any]:
        """Hand one request to the thread; the future gets ``backend.admit(payload).result()``."""
        return self._enqueue(lambda waiter: _Admission(payload, waiter))

    def run_between_steps(self, action: Callable[[], T], *, fatal: bool) -> asyncio.Future[T]:
        """Run ``action`` on the thread between two steps (invariant 2); the future gets its return value.

        ``fatal``: an exception from ``action`` kills the engine (every waiter gets EngineDeadError,
        this one too), for actions that can leave the backend half-changed.
        """
        return self._enqueue(lambda waiter: _BetweenSteps(action, waiter, fatal))

    async def close(self) -> None:
        """Stop after the step in progress, fail what is still waiting, and join the thread; idempotent."""
        with self._wake:
            if not self._closing:
                self._closing = True
                self._failure = self._failure or CLOSED
                self._inbox.append(_Stop())
                self._wake.notify()
        await asyncio.to_thread(self._thread.join)

    def _enqueue(self, make: Callable[[asyncio.Future[Any]], _Item]) -> asyncio.Future[Any]:
        waiter = self._loop.create_future()
        with self._wake:
            if self._failure is not None:
                raise EngineDeadError(self._failure)
            self._inbox.append(make(waiter))
            self._wake.notify()
        self._open.add(waiter)
        waiter.add_done_callback(self._open.discard)
        return waiter

    def _settle(self, settlements: list[_Settlement]) -> None:
        """On the loop: set each waiter once; one a caller has cancelled is skipped."""
        for waiter, result, error in settlements:
            self._open.discard(waiter)
            if waiter.done():
                continue
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(result)

    # ---- the thread's side -----------------------------------------------------------------

    def _run(self) -> None:
        """The thread: apply the inbox, step while there is work, post what finished; sleep when idle."""
        try:
            self._backend.open()
            while True:
                items = self._take(block=not self._backend.has_unfinished())
                if not self._apply(items):
                    break
                if self._backend.has_unfinished():
                    self._backend.step()
                    self._steps += 1
                self._post(self._finished())
            self._fail_everything(CLOSED, [])
        except _Fatal as fatal:
            self._fail_everything(fatal.reason, fatal.items)
        except BaseException as exc:
            reason = f"the engine failed in a step: {type(exc).__name__}: {exc}"
            log.exception("%s: engine step failed", self._name)
            self._fail_everything(reason, [])
        finally:
            try:
                self._backend.shut()
            except Exception:
                log.exception("%s: releasing the engine thread failed", self._name)

    def _take(self, *, block: bool) -> list[_Item]:
        """Everything in the inbox; waits for something first when ``block``."""
        with self._wake:
            while block and not self._inbox:
                self._wake.wait()
            items = list(self._inbox)
            self._inbox.clear()
        return items

    def _apply(self, items: list[_Item]) -> bool:
        """Apply ``items`` in order (invariant 2); False at a stop. A fatal action raises :class:`_Fatal`."""
        settled: list[_Settlement] = []
        for index, item in enumerate(items):
            if isinstance(item, _Stop):
                self._post(settled)
                self._post(_dead(items[index + 1 :], CLOSED))
                return False
            if isinstance(item, _Admission):
                try:
                    self._in_flight.append((self._backend.admit(item.payload), item.waiter))
                except Exception as exc:
                    settled.append((item.waiter, None, exc))
                continue
            try:
                settled.append((item.waiter, item.action(), None))
            except Exception as exc:
                if item.fatal:
                    self._post(settled)
                    reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, EngineError) else str(exc)
                    raise _Fatal(reason, items[index:]) from exc
                settled.append((item.waiter, None, exc))
        self._post(settled)
        return True

    def _finished(self) -> list[_Settlement]:
        """Take the in-flight requests whose outcome is done."""
        done: list[_Settlement] = []
        running: list[tuple[Outcome, asyncio.Future[Any]]] = []
        for outcome, waiter in self._in_flight:
            if not outcome.done():
                running.append((outcome, waiter))
                continue
            try:
                done.append((waiter, outcome.result(), None))
            except asyncio.CancelledError:
                done.append((waiter, None, EngineDeadError("the request was cancelled inside the engine")))
            except Exception as exc:
                done.append((waiter, None, exc))
        self._in_flight = running
        return done

    def _fail_everything(self, reason: str, items: Iterable[_Item]) -> None:
        """Refuse new work (under the lock), then fail every waiter still held: invariant 3."""
        with self._wake:
            if self._failure is None or (self._failure == CLOSED and reason != CLOSED):
                self._failure = reason
            reason = self._failure
            queued = list(self._inbox)
            self._inbox.clear()
        held = [waiter for _, waiter in self._in_flight]
        self._in_flight = []
        self._post([(w, None, EngineDeadError(reason)) for w in held] + _dead([*items, *queued], reason))

    def _post(self, settlements: list[_Settlement]) -> None:
        """Hand settlements to the loop in one callback; dropped (with a log line) if the loop is gone."""
        if not settlements:
            return
        try:
            self._loop.call_soon_threadsafe(self._settle, settlements)
        except RuntimeError:
            log.warning("%s: the event loop is closed; %d result(s) dropped", self._name, len(settlements))


class _Fatal(Exception):
    """A fatal between-step action failed: ``items`` (it and what followed it) are failed with ``reason``."""

    def __init__(self, reason: str, items: list[_Item]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.items = items


def _dead(items: Iterable[_Item], reason: str) -> list[_Settlement]:
    """EngineDeadError settlements for the waiters of ``items`` (a stop marker has none)."""
    return [(item.waiter, None, EngineDeadError(reason)) for item in items if not isinstance(item, _Stop)]
