"""Phase ``checkpoint`` while the training thread saves with torch.distributed.checkpoint.

:func:`install` wraps ``torch.distributed.checkpoint.state_dict_saver``'s ``save`` and
``async_save`` (and the same names in ``torch.distributed.checkpoint``) the moment that module
is imported, or at once when it already is; nothing here imports torch. While a wrapped call
runs, every WorkerServer of the process says phase ``checkpoint``; the phase before comes back
when it returns or raises. ``async_save`` counts for its synchronous part only (staging, the
plan): the upload that torch runs on its ``AsyncCheckpointExecutor`` thread leaves the phase
alone, since the loop goes on meanwhile. A save made another way is marked with
:func:`checkpointing` or ``state.set_phase("checkpoint")``. A torch whose saver looks different
costs one line on stderr; the job never fails because of this.

:func:`busy` marks other work a group does on its own outside the training step's collectives
(an eval, a data loader restarted at an epoch's end): phase ``busy``, which a monitor holds as it
holds a save, where the other groups waiting for it would otherwise read as a hang.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .autostart import SAVER, hook_import, say

_MARK = "_lightkeeper_checkpoint_phase"


def install() -> None:
    """Wrap DCP's saves now if imported, else when they are; never raises."""
    module = sys.modules.get(SAVER)
    if module is not None:
        patch(module)
    else:
        hook_import(SAVER, patch)


def patch(module: Any) -> bool:
    """Wrap ``module.save`` and ``module.async_save`` (idempotent); whether it did."""
    try:
        package = sys.modules.get(SAVER.rpartition(".")[0])
        for name in ("save", "async_save"):
            original = getattr(module, name)
            if getattr(original, _MARK, False):
                continue
            wrapped = _phased(original)
            setattr(module, name, wrapped)
            if package is not None and getattr(package, name, None) is original:
                setattr(package, name, wrapped)  # dcp.save: bound by the package's import
        return True
    except Exception as e:
        say(f"cannot mark torch.distributed.checkpoint's saves as phase checkpoint "
            f"({type(e).__name__}: {e}); training goes on")
        return False


def _phased(original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with checkpointing():
            return original(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


@contextlib.contextmanager
def checkpointing() -> Iterator[None]:
    """Phase ``checkpoint`` on this process's WorkerServers for the block, then the one before."""
    if threading.current_thread().name.startswith("AsyncCheckpointExecutor"):
        yield  # async_save's upload: the training thread is elsewhere
        return
    with _phase("checkpoint"):
        yield


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Phase ``busy`` on this process's WorkerServers for the block, then the one before: work
    of this group alone, outside the step's collectives, that the others may wait for (an eval
    between steps). Call it from the training loop's thread."""
    with _phase("busy"):
        yield


@contextlib.contextmanager
def _phase(phase: str) -> Iterator[None]:
    before = []
    # a process that never started a WorkerServer has none to mark: its Flask stays unimported
    module = sys.modules.get("worker_server.server")
    serving = getattr(module, "serving", None)  # None too while it still imports
    try:
        for server in serving() if serving else ():
            before.append((server.state, server.state.phase))
            server.state.set_phase(phase)
    except Exception as e:  # bookkeeping: never the work's failure
        say(f"phase {phase} not set ({type(e).__name__}: {e})")
    try:
        yield
    finally:
        for state, was in before:
            if state.phase == phase:
                state.set_phase(was)
