"""``wait_quorum_s`` (worker_server/instrument.py, timing.py): a step's quorum timed from the
rank's ``start_quorum`` call to the completion of torchft's ``_quorum_future``, for the
synchronous and the asynchronous quorum, not the later block in ``wait_quorum``.

The Manager is a fake written after torchft's manager.py (0.2.0 and nightly: ``start_quorum``
submits ``_async_quorum`` to a one-thread ``ThreadPoolExecutor`` as ``_quorum_future``, then,
synchronous, calls ``wait_quorum``): a real one needs a Lighthouse and a ManagerServer, and
its quorum's completion could not be set to a chosen instant. The executor is real, so the
done-callback runs on its thread as in torchft. The clock is a counter the test advances; a
no-op task on the same one-thread executor is the barrier after which the quorum future's
callbacks have run (its worker runs them before taking the next task)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from tests.support.clock import ManualClock
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server.timing import StepTimer


class QuorumManager:
    """torchft's Manager as the wrappers use it, its quorum released by the test."""

    def __init__(self, use_async: bool) -> None:
        self._use_async_quorum = use_async
        self._executor = ThreadPoolExecutor(max_workers=1)
        self._quorum_future = None
        self._quorum_id, self._step = 1, 0
        self.release = threading.Semaphore(0)

    def _async_quorum(self) -> None:
        assert self.release.acquire(timeout=10), "the test never released the quorum"

    def start_quorum(self) -> None:
        if self._quorum_future is not None:  # torchft waits for the previous one first
            self._quorum_future.result()
        self._quorum_future = self._executor.submit(self._async_quorum)
        if not self._use_async_quorum:
            self.wait_quorum()

    def wait_quorum(self) -> None:
        self._quorum_future.result()

    def allreduce(self, tensor):
        return SimpleNamespace(wait=lambda: tensor)

    def should_commit(self) -> bool:  # torchft's waits on the future first; the test does
        self._step += 1
        return True

    def current_step(self) -> int:
        return self._step

    def num_participants(self) -> int:
        return 2

    def is_participating(self) -> bool:
        return True

    def callbacks_ran(self) -> None:
        self._executor.submit(lambda: None).result(timeout=10)


def attached(manager, clock) -> RankState:
    state = RankState(RankIdentity())
    state.timing = StepTimer(clock=clock, device=False)
    WorkerServer(state).attach(manager)
    return state


def in_wait(state: RankState) -> None:
    """Until the training thread is blocked in a cross-group wait (poll, with a deadline)."""
    deadline = time.monotonic() + 10
    while state.timing.snapshot()["waiting"] is None:
        assert time.monotonic() < deadline, "the training thread never waited"
        time.sleep(0.001)


def released_after(state, manager, clock, seconds: float) -> threading.Thread:
    """Another thread: once the training thread waits, ``seconds`` pass, the quorum completes."""
    def run():
        in_wait(state)
        clock.advance(seconds)
        manager.release.release()

    t = threading.Thread(target=run)
    t.start()
    return t


def served(state) -> dict[int, float]:
    return {q["step"]: q["wait_quorum_s"] for q in state.snapshot()["timing"]["recent_quorum"]}


def test_a_synchronous_quorum_is_timed_from_the_call_to_its_completion():
    clock, manager = ManualClock(), QuorumManager(use_async=False)
    state = attached(manager, clock)
    for step in range(2):
        t = released_after(state, manager, clock, 0.3)  # blocks inside start_quorum
        manager.start_quorum()
        t.join(10)
        manager.callbacks_ran()
        clock.advance(0.5)  # forward, backward
        manager.wait_quorum()
        manager.allreduce(1).wait()
        assert manager.should_commit()
        assert served(state)[step] == pytest.approx(0.3)
    manager._executor.shutdown()


def test_an_asynchronous_quorum_is_timed_to_its_completion_not_the_later_block():
    """The quorum completes 0.7 s after the call, 0.2 s into the rank's wait_quorum after its
    0.5 s forward: the rank reached its quorum 0.7 s before the job's last arrival, whatever
    it blocks there."""
    clock, manager = ManualClock(), QuorumManager(use_async=True)
    state = attached(manager, clock)
    manager.start_quorum()  # returns at once: the quorum runs beside the forward pass
    clock.advance(0.5)
    t = released_after(state, manager, clock, 0.2)
    manager.wait_quorum()
    t.join(10)
    manager.callbacks_ran()
    clock.advance(0.1)
    manager.allreduce(1).wait()
    assert manager.should_commit()
    row = state.snapshot()["timing"]["last_step"]
    assert served(state) == {0: pytest.approx(0.7)}
    assert row["wait_cross_s"] == pytest.approx(0.2)  # the block, as before
    manager._executor.shutdown()


def test_a_quorum_completing_after_its_step_ended_is_dropped():
    clock, manager = ManualClock(), QuorumManager(use_async=True)
    state = attached(manager, clock)
    manager.start_quorum()
    clock.advance(0.4)
    assert manager.should_commit()  # this fake commits without waiting on the quorum
    manager.release.release()
    manager.callbacks_ran()  # the late completion: step 0 has ended, step 1 runs
    clock.advance(0.1)
    manager.start_quorum()
    clock.advance(0.25)
    manager.release.release()
    manager.callbacks_ran()
    manager.wait_quorum()
    assert manager.should_commit()
    assert [r["step"] for r in state.snapshot()["timing"]["recent"]] == [0, 1]
    assert served(state) == {1: pytest.approx(0.25)}  # not 0.5 (step 0's), and none for 0
    manager._executor.shutdown()


class NoFuture(QuorumManager):
    """A torchft whose Manager keeps no ``_quorum_future``."""

    def __init__(self) -> None:
        super().__init__(use_async=True)
        del self._quorum_future

    def start_quorum(self) -> None:
        pass

    def wait_quorum(self) -> None:
        pass


def test_without_a_quorum_future_the_rows_have_none_and_one_line_says_so(capsys):
    clock, manager = ManualClock(), NoFuture()
    state = attached(manager, clock)
    for _ in range(3):
        manager.start_quorum()
        clock.advance(0.2)
        manager.wait_quorum()
        assert manager.should_commit()
    snap = state.snapshot()["timing"]
    assert len(snap["recent"]) == 3 and snap["recent_quorum"] == []
    # (the fake has no process group: another line says its Flight Recorder is not tracked)
    err = [e for e in capsys.readouterr().err.splitlines() if "wait_quorum_s" in e]
    assert len(err) == 1 and "torchft's quorum cannot be timed (AttributeError" in err[0], err
    assert "training goes on" in err[0]
    manager._executor.shutdown()
