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

    @functools.wraps(start_quorum)
    def start_quorum_wrapper(*args, **kwargs):
        state.step_started()
        state.set_phase("quorum")
        step_at_start[0] = manager.current_step()
        result = start_quorum(*args, **kwargs)
        state.set_phase("forward")
        return result

    @functools.wraps(wait_quorum)
    def wait_quorum_wrapper(*args, **kwargs):
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
        return allreduce(*args, **kwargs)

    @functools.wraps(should_commit)
    def should_commit_wrapper(*args, **kwargs):
        if getattr(manager, "_healing", False):
            state.set_phase("healing")  # should_commit loads the peer's state first
        state.set_phase("commit")
        committed = should_commit(*args, **kwargs)
        _update_quorum(manager, state)
        state.step_finished(manager.current_step(), committed)
        state.set_phase("optimizer")
        return committed

    manager.start_quorum = start_quorum_wrapper
    manager.wait_quorum = wait_quorum_wrapper
    manager.allreduce = allreduce_wrapper
    manager.should_commit = should_commit_wrapper
