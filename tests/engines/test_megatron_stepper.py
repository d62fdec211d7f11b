"""The Megatron engine's step thread (tasks/engines/megatron/stepper.py) on CPU, with a fake step backend.

``FakeStepBackend`` stands in for megatron's dynamic engine: a request (payload = how many steps
it needs) finishes after that many steps and returns the weight versions it was stepped under.
Also :class:`tasks.engines.megatron.step_backend.MegatronStepBackend` over a fake megatron engine, to check
that megatron's request futures live on the step thread's own loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any

import pytest

from tasks.engines.megatron.stepper import StepThread
from tasks.errors import EngineDeadError, EngineError

TIMEOUT = 10


class FakeStepBackend:
    """A fake engine: ``admit(n)`` finishes after n steps with the weight versions of those steps."""

    def __init__(self, *, fail_at_step: int | None = None, refuse: object = None) -> None:
        self.weights = 0
        self.events: list[tuple[str, Any]] = []  # appended on the step thread only
        self.threads: set[int] = set()
        self.gate: threading.Event | None = None  # when set up, each step waits for it
        self.step_started = threading.Event()
        self.opened = self.shut_down = False
        self._fail_at_step = fail_at_step
        self._refuse = refuse
        self._running: list[tuple[int, list[int], concurrent.futures.Future[list[int]]]] = []
        self._steps = 0

    def open(self) -> None:
        self.opened = True
        self.threads.add(threading.get_ident())

    def admit(self, payload: Any) -> concurrent.futures.Future[list[int]]:
        self.threads.add(threading.get_ident())
        if payload == self._refuse:
            raise EngineError(f"refused {payload!r}")
        self.events.append(("admit", payload))
        future: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
        self._running.append((payload, [], future))
        return future

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def step(self) -> None:
        self.threads.add(threading.get_ident())
        self.step_started.set()
        if self.gate is not None:
            assert self.gate.wait(TIMEOUT)
        self._steps += 1
        if self._steps == self._fail_at_step:
            raise RuntimeError("the fake step blew up")
        self.events.append(("step", self.weights))
        running = []
        for need, seen, future in self._running:
            seen.append(self.weights)
            if len(seen) == need:
                future.set_result(seen)
            else:
                running.append((need, seen, future))
        self._running = running

    def shut(self) -> None:
        self.shut_down = True

    def refit(self, version: int) -> int:
        """A between-step action: the fake's weights become ``version``."""
        self.events.append(("refit", version))
        self.weights = version
        return version


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def test_requests_submitted_from_the_loop_complete_on_the_step_thread() -> None:
    backend = FakeStepBackend()

    async def scenario() -> tuple[list[list[int]], StepThread]:
        stepper = StepThread(backend, asyncio.get_running_loop(), name="fake-steps")
        results = await asyncio.gather(*(stepper.submit(n) for n in (1, 3, 5)))
        assert stepper.unfinished == 0 and stepper.steps == 5 and stepper.failure is None
        await stepper.close()
        return results, stepper

    results, stepper = run(scenario())
    assert results == [[0], [0, 0, 0], [0] * 5]
    assert backend.opened and backend.shut_down and stepper.failure == "the engine was closed"
    assert len(backend.threads) == 1 and threading.get_ident() not in backend.threads


def test_a_step_does_not_hold_the_event_loop() -> None:
    """While a step is blocked, coroutines on the loop keep running (the point of the thread)."""
    backend = FakeStepBackend()
    backend.gate = threading.Event()

    async def scenario() -> None:
        stepper = StepThread(backend, asyncio.get_running_loop(), name="fake-steps")
        request = stepper.submit(2)
        await asyncio.to_thread(backend.step_started.wait, TIMEOUT)
        ticks = 0
        for _ in range(20):
            await asyncio.sleep(0.001)
            ticks += 1
        assert ticks == 20 and not request.done() and stepper.unfinished == 1
        backend.gate.set()
        assert await request == [0, 0]
        await stepper.close()

    run(scenario())


def test_a_refit_lands_between_two_steps_and_in_fifo_order_with_admissions() -> None:
    backend = FakeStepBackend()
    backend.gate = threading.Event()

    async def scenario() -> tuple[list[int], list[int], int]:
        stepper = StepThread(backend, asyncio.get_running_loop(), name="fake-steps")
        spanning = stepper.submit(4)
        await asyncio.to_thread(backend.step_started.wait, TIMEOUT)  # step 1 is in progress
        before = stepper.submit(2)  # queued ahead of the refit: admitted under the old weights
        refit = stepper.run_between_steps(lambda: backend.refit(1), fatal=True)
        after = stepper.submit(2)
        backend.gate.set()
        version = await refit
        results = await asyncio.gather(spanning, before, after)
        await stepper.close()
        return results, version

    (spanning, before, after), version = run(scenario())
    assert version == 1
    assert spanning == [0, 1, 1, 1]  # in flight across the refit: stepped under both weights
    assert before == [1, 1] and after == [1, 1]
    events = backend.events
    refit_at = events.index(("refit", 1))
    assert events[refit_at - 1] == ("admit", 2) and events[refit_at + 1] == ("admit", 2)
    assert ("step", 0) in events[:refit_at] and all(e[0] != "step" for e in events[refit_at - 1 : refit_at + 2])


def test_an_exception_in_a_step_fails_every_waiter_and_refuses_new_work() -> None:
    backend = FakeStepBackend(fail_at_step=2)

    async def scenario() -> list[BaseException | list[int]]:
        stepper = StepThread(backend, asyncio.get_running_loop(), name="fake-steps")
        outcomes = await asyncio.gather(stepper.submit(1), stepper.submit(5), stepper.submit(7), return_exceptions=True)
        assert stepper.unfinished == 0 and "the fake step blew up" in (stepper.failure or "")
        with pytest.raises(EngineDeadError, match="the fake step blew up"):
            stepper.submit(1)
        with pytest.raises(EngineDeadError):
            stepper.run_between_steps(lambda: None, fatal=False)
        await stepper.close()  # joins a thread that has already ended
        assert "the fake step blew up" in (stepper.failure or "")
        return outcomes

    first, second, third = run(scenario())
    assert first == [0]
    for outcome in (second, third):
        assert isinstance(outcome, EngineDeadError)
        assert str(outcome) == "the engine failed in a step: RuntimeError: the fake step blew up"
    assert backend.shut_down


def test_work_queued_behind_a_failing_step_is_failed_too() -> None:
    backend = FakeStepBackend(fail_at_step=1)
    backend.gate = threading.Event()

    async def scenario() -> list[BaseException | Any]:
        stepper = StepThread(backend, asyncio.get_running_loop(), name="fake-steps")
        first = stepper.submit(3)
        await asyncio.to_thread(backend.step_started.wait, TIMEOUT)
        queued = [stepper.submit(1), stepper.run_between_steps(lambda: backend.refit(9), fatal=True)]
        backend.gate.set()
        outcomes = await asyncio.gather(first, *queued, return_exceptions=True)
        await stepper.close()
        return outcomes

    outcomes = run(scenario())
    assert all(isinstance(o, EngineDeadError) for o in outcomes)
    assert ("refit", 9) not in backend.events


def test_close_joins_the_thread_and_fails_what_is_in_flight() -> None:
    backend = FakeStepBackend()
    backend.gate = threading.Event()

    async def scenario() -> tuple[StepThread, list[BaseException | Any]]:
        stepper = StepThread(backend, asyncio.get_running_loop(), name="fake-steps")
        in_flight = stepper.submit(100)
        await asyncio.to_thread(backend.step_started.wait, TIMEOUT)
        closing = asyncio.ensure_future(stepper.close())
        await asyncio.sleep(0.01)
        assert not closing.done(), "close() returned while a step was still running"
        with pytest.raises(EngineDeadError, match="closed"):
            stepper.submit(1)
        backend.gate.set()
        await closing
        assert not stepper._thread.is_alive()
        await stepper.close()  # idempotent
        return stepper, await asyncio.gather(in_flight, return_exceptions=True)

    stepper, (outcome,) = run(scenario())
    assert isinstance(outcome, EngineDeadError) and "closed" in str(outcome)
    assert backend.shut_down and stepper.unfinished == 0


def test_a_refused_admission_or_a_failed_non_fatal_action_fails_only_its_waiter() -> None:
    backend = FakeStepBackend(refuse="bad")

    def broken() -> None:
        raise ValueError("not fatal")

    async def scenario() -> list[BaseException | Any]:
        stepper = StepThread(backend, asyncio.get_running_loop(), name="fake-steps")
        outcomes = await asyncio.gather(
            stepper.submit("bad"), stepper.run_between_steps(broken, fatal=False), stepper.submit(2),
            return_exceptions=True,
        )  # fmt: skip
        assert stepper.failure is None
        assert await stepper.submit(1) == [0]
        await stepper.close()
        return outcomes

    refused, failed, served = run(scenario())
    assert isinstance(refused, EngineError) and not isinstance(refused, EngineDeadError)
    assert str(refused) == "refused 'bad'"
    assert isinstance(failed, ValueError) and served == [0, 0]


def test_a_failed_fatal_action_kills_the_engine_with_its_message() -> None:
    backend = FakeStepBackend()
    backend.gate = threading.Event()

    def half_copied() -> None:
        raise EngineError("refit to /m failed: RuntimeError: size mismatch")

    async def scenario() -> list[BaseException | Any]:
        stepper = StepThread(backend, asyncio.get_running_loop(), name="fake-steps")
        in_flight = stepper.submit(3)
        await asyncio.to_thread(backend.step_started.wait, TIMEOUT)
        refit = stepper.run_between_steps(half_copied, fatal=True)
        behind = stepper.submit(1)
        backend.gate.set()
        outcomes = await asyncio.gather(in_flight, refit, behind, return_exceptions=True)
        assert stepper.failure == "refit to /m failed: RuntimeError: size mismatch"
        await stepper.close()
        return outcomes

    for outcome in run(scenario()):
        assert isinstance(outcome, EngineDeadError)
        assert str(outcome) == "refit to /m failed: RuntimeError: size mismatch"


def test_a_caller_cancelling_its_wait_does_not_disturb_the_others() -> None:
    backend = FakeStepBackend()

    async def scenario() -> list[int]:
        stepper = StepThread(backend, asyncio.get_running_loop(), name="fake-steps")
        gone = stepper.submit(3)
        kept = stepper.submit(3)
        gone.cancel()
        result = await kept
        await asyncio.sleep(0.01)
        assert stepper.unfinished == 0 and stepper.failure is None
        await stepper.close()
        return result

    assert run(scenario()) == [0, 0, 0]


class _FakeMegatronEngine:
    """Just the surface of megatron's DynamicInferenceEngine that MegatronStepBackend uses."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop  # megatron binds the creating loop
        self.requests: dict[int, tuple[asyncio.Future[Any], int]] = {}

    def add_request(self, request_id: int, prompt: list[int], params: Any) -> asyncio.Future[Any]:
        if not prompt:
            raise ValueError("empty")
        future = self._loop.create_future()
        self.requests[request_id] = (future, params)
        return future

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    async def async_step(self) -> None:
        assert asyncio.get_running_loop() is self._loop
        await asyncio.sleep(0)
        for request_id, (future, left) in list(self.requests.items()):
            if left <= 1:
                del self.requests[request_id]
                future.set_result(f"record-{request_id}")
            else:
                self.requests[request_id] = (future, left - 1)


def test_the_megatron_backend_steps_megatron_on_the_thread_own_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron's request futures are created and resolved on the step thread's loop, not the caller's."""
    torch = pytest.importorskip("torch")
    from tasks.engines.megatron.step_backend import Admission, MegatronStepBackend

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    async def scenario() -> tuple[list[Any], BaseException | None, _FakeMegatronEngine]:
        loop = asyncio.get_running_loop()
        fake = _FakeMegatronEngine(loop)
        stepper = StepThread(MegatronStepBackend(fake), loop, name="fake-megatron-steps")
        results = await asyncio.gather(
            *(stepper.submit(Admission(f"r{i}", i, [1, 2], i + 1)) for i in range(3))
        )  # fmt: skip
        try:
            await stepper.submit(Admission("empty", 9, [], 1))
            refused = None
        except EngineError as exc:
            refused = exc
        assert fake._loop is not loop
        await stepper.close()
        return results, refused, fake

    results, refused, fake = run(scenario())
    assert results == ["record-0", "record-1", "record-2"]
    assert str(refused) == "request empty: megatron refused it: ValueError: empty"
    assert fake._loop.is_closed()


def test_an_idle_step_thread_sleeps() -> None:
    """No busy wait: with nothing to do the thread blocks on its condition, and runs no steps."""
    backend = FakeStepBackend()

    async def scenario() -> int:
        stepper = StepThread(backend, asyncio.get_running_loop(), name="fake-steps")
        await stepper.submit(1)
        steps = stepper.steps
        started = time.process_time()
        await asyncio.sleep(0.2)
        assert time.process_time() - started < 0.1
        await stepper.close()
        return stepper.steps - steps

    assert run(scenario()) == 0
