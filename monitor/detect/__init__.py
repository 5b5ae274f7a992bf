"""Detect: from the cluster view (and Flight Recorder dumps) to findings; the facade is
:class:`Detectors`, one module per finding kind beside it."""

from .detectors import Detectors
from .findings import JOB_KINDS, KINDS, Finding
from .rank_state import collective_wait, current_wait

__all__ = ["JOB_KINDS", "KINDS", "Detectors", "Finding", "collective_wait", "current_wait"]
