"""Per-rank HTTP debug server: step state, Flight Recorder dump, thread stacks and metrics.

Public API: :class:`WorkerServer` (start/stop, instrument a torchft Manager),
:class:`RankState` (what the training loop reports), :func:`create_app` (the Flask app).
"""

from .app import create_app
from .server import WorkerServer
from .state import PHASES, RankIdentity, RankState

__all__ = ["PHASES", "RankIdentity", "RankState", "WorkerServer", "create_app"]
