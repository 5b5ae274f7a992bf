"""Detect: from the cluster view (and Flight Recorder dumps) to findings; the facade is
:class:`Detectors`, one module per finding kind beside it."""

from .detectors import Analyzer, Detectors
from .findings import KINDS, Finding
from .rank_state import collective_wait, current_wait

__all__ = ["KINDS", "Analyzer", "Detectors", "Finding", "collective_wait", "current_wait"]
