"""Instrument a torchft ``Manager`` so its rank's state is visible without changing the loop.

Wraps, on the Manager *instance*, the calls every torchft loop makes:

- ``start_quorum`` (``OptimizerWrapper.zero_grad``): a step begins; phase ``quorum`` then
  ``forward`` (the quorum runs asynchronously during the forward pass);
- ``wait_quorum``: quorum id, participants and participation become known;
- ``allreduce``: phase ``allreduce`` (``quorum`` while it first waits for an asynchronous quorum);
- ``should_commit`` (``OptimizerWrapper.step``): phase ``commit`` (``healing`` instead when this
  group recovers from a peer: torchft loads the peer's state there), then the step is finished
  and phase ``optimizer``.

It also hooks the call that rebuilds the Manager's process group (one per quorum change) through
:class:`~worker_server.flight_recorder.IncarnationTracker`. A loop that wants finer phases calls
``state.set_phase("backward")`` itself. The wrappers never swallow the Manager's exceptions, and
none of their own reaches the loop: a Manager whose internals differ (another torchft) gets what
can be instrumented, one line on stderr names the rest, and a bookkeeping error inside a wrapper
is said once and ignored. The bookkeeping's own calls into the Manager (``num_participants``
waits on the quorum) go straight to torchft: they are not the job's waits, and through the
wrappers they would recurse (``wait_quorum`` -> bookkeeping -> ``wait_quorum`` ...).

The same wrappers time the training thread's waits (:mod:`worker_server.timing`), and each
step's quorum from the ``start_quorum`` call to its future's completion (``wait_quorum_s``, a
done-callback on torchft's ``_quorum_future``: a synchronous quorum's is put on while
``start_quorum`` waits inside ``wait_quorum``, an asynchronous one's when it returns): the quorum and
``allreduce`` (through its Work's ``wait()``) as cross-group wait, ``should_commit`` as in-group
wait, and the end of ``should_commit`` closes the step and begins the next: a step's time
(``last_step_seconds``, like the timer's ``step_s``) runs commit to commit, so with LocalSGD or
DiLoCo, whose ``should_commit`` comes once a sync, a step is a sync and its time the inner
steps'. :func:`instrument_fsdp` adds FSDP2's in-group all-gathers and reduce-scatters.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

from .autostart import say
from .flight_recorder import IncarnationTracker
from .state import RankState, library_versions


def replica_id_of(manager: Any) -> str | None:
    """torchft's full replica id (``<prefix>:<uuid>``) as the Lighthouse knows it."""
    try:  # a torchft Manager's module is imported: a stand-in's import no torch for it
        key = sys.modules["torchft.manager"].REPLICA_ID_KEY
        return manager._store.get(key).decode("utf-8") or None
    except Exception:
        return None


def quorum_pending(manager: Any) -> bool:
    """The step's quorum is asked for and not reached yet (torchft's ``_quorum_future``); False
    for a Manager without one."""
    future = getattr(manager, "_quorum_future", None)
    return future is not None and not future.done()


def _update_quorum(manager: Any, state: RankState) -> None:
    """Read once the quorum is known (after ``wait_quorum`` and ``should_commit`` returned); an
    error is the bookkeeping's, said once by the caller (it hid a recursion here before)."""
    # torchft's is_participating() asserts an async quorum while healing; a healing group
    # takes no part in the step either way
    participating = not getattr(manager, "_healing", False) and bool(manager.is_participating())
    state.set_quorum(int(manager._quorum_id), int(manager.num_participants()), participating)


def instrument_manager(manager: Any, state: RankState, tracker: IncarnationTracker) -> None:
    """Wrap ``manager``'s calls (see the module doc); never raises."""
    if getattr(manager, "_lightkeeper_instrumented", False):
        return
    from .checkpoint import install

    install()  # phase checkpoint while torch.distributed.checkpoint saves
    missing: list[str] = []
    try:
        manager._lightkeeper_instrumented = True
    except Exception:
        pass  # an object without attributes: its methods cannot be wrapped either (said below)
    state.replica_id = replica_id_of(manager)
    try:
        tracker.hook(manager)
    except Exception as e:
        missing.append(f"Flight Recorder incarnations ({type(e).__name__}: {e})")
    said: list[bool] = []
    own = threading.local()  # .on while the bookkeeping below calls the Manager

    def quietly(fn, *args):
        """Run the wrappers' own bookkeeping: an error is said once, never raised."""
        own.on = True
        try:
            return fn(*args)
        except Exception as e:
            if not said:
                said.append(True)
                say(f"WorkerServer: step bookkeeping failed ({type(e).__name__}: {e}); "
                    "training goes on, this rank's state may be stale")
            return None
        finally:
            own.on = False

    # The step before this step's quorum: a quorum that moves it means this group healed
    # (torchft sets the step to the quorum's max_step after loading a peer's state).
    step_at_start: list[int | None] = [None]
    timer = state.timing
    first = [True]
    quorum_done: list = [None]  # this step's quorum callback, until it is on torchft's future
    untimed: list[bool] = []

    def begin() -> None:
        if first[0]:  # later steps begin where the last ended, as the timer's (commit to commit)
            first[0] = False
            state.step_started()
        timer.begin_step()
        quorum_done[0] = timer.quorum_called()
        state.set_phase("quorum")
        step_at_start[0] = manager.current_step()

    def watch_quorum() -> None:
        done, quorum_done[0] = quorum_done[0], None
        if done is None:
            return
        try:  # never into torchft: the row then has no wait_quorum_s
            manager._quorum_future.add_done_callback(done)
        except Exception as e:
            if not untimed:
                untimed.append(True)
                say(f"WorkerServer: torchft's quorum cannot be timed ({type(e).__name__}: {e}); "
                    "wait_quorum_s is not served, training goes on")

    def quorum_known() -> None:
        before = step_at_start[0]
        if before is not None:
            step_at_start[0] = None  # once per step: allreduce waits on the quorum again
            if manager.current_step() != before:
                state.healed(manager.current_step())
        _update_quorum(manager, state)  # last, as in committed()

    def commit_begins() -> int:
        # a healing step's should_commit loads the peer's state first (seconds on a large
        # model), then votes: shown as healing until it returns
        state.set_phase("healing" if getattr(manager, "_healing", False) else "commit")
        return manager.current_step()

    def committed(ran_as: int | None, ok: bool) -> None:
        # torchft runs an uncommitted step again under the same number: its time stays in that
        # step's one row (commit to commit), and a reader asking ?since=N misses no retry
        if ran_as is not None and ok:
            timer.end_step(ran_as)
        state.step_finished(manager.current_step(), ok)
        state.step_started()
        state.set_phase("optimizer")
        # last: a torchft without the private _quorum_id still shows its steps, not a hang
        _update_quorum(manager, state)

    def start_quorum(original, *args, **kwargs):
        quietly(begin)
        with timer.waiting("cross"):  # a synchronous quorum blocks here
            result = original(*args, **kwargs)
        quietly(watch_quorum)
        state.set_phase("forward")
        return result

    def wait_quorum(original, *args, **kwargs):
        quietly(watch_quorum)  # a synchronous start_quorum's, its future still running
        with timer.waiting("cross"):
            result = original(*args, **kwargs)
        quietly(quorum_known)
        return result

    def allreduce(original, *args, **kwargs):
        # torchft's allreduce waits for an asynchronous quorum first: until it is reached the
        # rank is in no collective (an abort then would fail the new quorum's step)
        state.set_phase("quorum" if quietly(quorum_pending, manager) else "allreduce")
        with timer.waiting("cross"):  # includes wait_quorum when the quorum is asynchronous
            work = original(*args, **kwargs)
        state.set_phase("allreduce")
        return _time_wait(work, timer, "cross")

    def should_commit(original, *args, **kwargs):
        ran_as = quietly(commit_begins)
        with timer.waiting("group"):  # the group's ranks vote through rank 0's ManagerServer
            ok = original(*args, **kwargs)
        quietly(committed, ran_as, ok)
        return ok

    for wrap in (start_quorum, wait_quorum, allreduce, should_commit):
        try:
            _wrap_method(manager, wrap, own)
        except Exception as e:
            missing.append(f"{wrap.__name__} ({type(e).__name__}: {e})")
    if missing:
        say(f"WorkerServer: cannot instrument {', '.join(missing)} of this torchft Manager "
            f"(torchft {library_versions()[1]}; supported: 0.2.x and nightly); the rest is "
            "served, training goes on")


def _wrap_method(manager: Any, wrap, own: threading.local) -> None:
    """``manager.<wrap's name>`` becomes ``wrap(original, *args, **kwargs)``, or the original
    alone while ``own.on`` (the wrappers' bookkeeping is calling)."""
    original = getattr(manager, wrap.__name__)
    if not callable(original):
        raise AttributeError(f"{wrap.__name__} is not callable")

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if getattr(own, "on", False):
            return original(*args, **kwargs)
        return wrap(original, *args, **kwargs)

    setattr(manager, wrap.__name__, wrapper)


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
