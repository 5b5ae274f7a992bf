"""Instrument a torchft ``Manager`` so its rank's state is visible without changing the loop.

Wraps, on the Manager *instance*, the calls every torchft loop makes:

- ``start_quorum`` (``OptimizerWrapper.zero_grad``): a step begins; phase ``quorum`` then
  ``forward`` (the quorum runs asynchronously during the forward pass);
- ``wait_quorum``: quorum id, participants and participation become known;
- ``allreduce``: phase ``allreduce``;
- ``should_commit`` (``OptimizerWrapper.step``): phase ``commit`` (``healing`` first when this
  group recovers from a peer), then the step is finished and phase ``optimizer``.

It also hooks the Manager's process group ``configure`` (one call per quorum change) through
:class:`~worker_server.flight_recorder.IncarnationTracker`. A loop that wants finer phases calls
``state.set_phase("backward")`` itself. The wrappers never swallow exceptions: they only record.

The same wrappers time the training thread's waits (:mod:`worker_server.timing`): the quorum and
``allreduce`` (through its Work's ``wait()``) as cross-group wait, ``should_commit`` as in-group
wait, and the end of ``should_commit`` closes the step. :func:`instrument_fsdp` adds FSDP2's
in-group all-gathers and reduce-scatters.
"""

from __future__ import annotations

import functools
from typing import Any

from .flight_recorder import IncarnationTracker
from .state import RankState


def replica_id_of(manager: Any) -> str | None:
    """torchft's full replica id (``<prefix>:<uuid>``) as the Lighthouse knows it."""
    try:
        from torchft.manager import REPLICA_ID_KEY

        return manager._store.get(REPLICA_ID_KEY).decode("utf-8") or None
    except Exception:
        return None


def _update_quorum(manager: Any, state: RankState) -> None:
    try:
        state.set_quorum(
            int(manager._quorum_id), int(manager.num_participants()), bool(manager.is_participating())
        )
    except Exception:
        pass  # quorum not formed yet (or errored): keep the last known values


def instrument_manager(manager: Any, state: RankState, tracker: IncarnationTracker) -> None:
    if getattr(manager, "_lightkeeper_instrumented", False):
        return
    manager._lightkeeper_instrumented = True
    state.replica_id = replica_id_of(manager)
    tracker.hook(manager._pg)

    start_quorum = manager.start_quorum
    wait_quorum = manager.wait_quorum
    allreduce = manager.allreduce
    should_commit = manager.should_commit

    # The step before this step's quorum: a quorum that moves it means this group healed
    # (torchft sets the step to the quorum's max_step after loading a peer's state).
    step_at_start: list[int | None] = [None]

    timer = state.timing

    @functools.wraps(start_quorum)
    def start_quorum_wrapper(*args, **kwargs):
        state.step_started()
        timer.begin_step()
        state.set_phase("quorum")
        step_at_start[0] = manager.current_step()
        with timer.waiting("cross"):  # a synchronous quorum blocks here
            result = start_quorum(*args, **kwargs)
        state.set_phase("forward")
        return result

    @functools.wraps(wait_quorum)
    def wait_quorum_wrapper(*args, **kwargs):
        with timer.waiting("cross"):
            result = wait_quorum(*args, **kwargs)
        _update_quorum(manager, state)
        before = step_at_start[0]
        if before is not None:
            step_at_start[0] = None  # once per step: allreduce waits on the quorum again
            if manager.current_step() != before:
                state.healed(manager.current_step())
        return result

    @functools.wraps(allreduce)
    def allreduce_wrapper(*args, **kwargs):
        state.set_phase("allreduce")
        with timer.waiting("cross"):  # includes wait_quorum when the quorum is asynchronous
            work = allreduce(*args, **kwargs)
        return _time_wait(work, timer, "cross")

    @functools.wraps(should_commit)
    def should_commit_wrapper(*args, **kwargs):
        if getattr(manager, "_healing", False):
            state.set_phase("healing")  # should_commit loads the peer's state first
        state.set_phase("commit")
        ran_as = manager.current_step()
        with timer.waiting("group"):  # the group's ranks vote through rank 0's ManagerServer
            committed = should_commit(*args, **kwargs)
        _update_quorum(manager, state)
        timer.end_step(ran_as)
        state.step_finished(manager.current_step(), committed)
        state.set_phase("optimizer")
        return committed

    manager.start_quorum = start_quorum_wrapper
    manager.wait_quorum = wait_quorum_wrapper
    manager.allreduce = allreduce_wrapper
    manager.should_commit = should_commit_wrapper


def _time_wait(work: Any, timer, scope: str) -> Any:
    """Count the time in ``work.wait()`` as a wait in ``scope``; returns the same Work.

    torchft's Works are Python objects, so the bound method is replaced on the instance; a Work
    that does not allow it is returned untimed."""
    wait = getattr(work, "wait", None)
    if wait is None:
        return work

    @functools.wraps(wait)
    def timed_wait(*args, **kwargs):
        with timer.waiting(scope):
            return wait(*args, **kwargs)

    try:
        work.wait = timed_wait
    except (AttributeError, TypeError):
        pass
    return work


def instrument_fsdp(model: Any, state: RankState) -> int:
    """Time FSDP2's in-group collectives of ``model`` as this rank's in-group wait.

    Call once after ``fully_shard``; returns how many FSDP modules were instrumented (0 for a
    model without FSDP). See :mod:`worker_server.fsdp`."""
    from .fsdp import time_fsdp_collectives

    return time_fsdp_collectives(model, state.timing)
