"""Per-rank HTTP debug server: step state, Flight Recorder dump, thread stacks and metrics.

Public API: :class:`WorkerServer` (start/stop, instrument a torchft Manager),
:class:`RankState` (what the training loop reports), :func:`create_app` (the Flask app).
They are imported on first use, so ``worker_server.autostart`` (loaded at every interpreter
start under ``lightkeeper run``) does not pay for Flask and waitress in processes that never
build a torchft Manager.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing costs every interpreter start under lightkeeper run

__all__ = ["PHASES", "RankIdentity", "RankState", "WorkerServer", "create_app"]

if TYPE_CHECKING:
    from .app import create_app
    from .server import WorkerServer
    from .state import PHASES, RankIdentity, RankState


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "WorkerServer":
        from .server import WorkerServer

        return WorkerServer
    if name in ("PHASES", "RankIdentity", "RankState"):
        from . import state

        return getattr(state, name)
    raise AttributeError(f"module 'worker_server' has no attribute {name!r}")
