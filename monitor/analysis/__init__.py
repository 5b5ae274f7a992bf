"""Flight Recorder analysis across ranks: which collectives went wrong, which ranks are to blame.
Pure functions, no torch; the rules and the JSON interface: docs/analyze.md.
"""

from .columnar import normalize
from .engine import analyze, normalize_dumps
from .findings import AnalysisResult, Finding, HangFinding, MismatchFinding, StragglerFinding
from .loader import LoadResult, load_paths
from .model import DumpFormatError, GroupKey, RankTrace
from .stragglers import StragglerConfig

__all__ = [
    "AnalysisResult", "DumpFormatError", "Finding", "GroupKey", "HangFinding", "LoadResult",
    "MismatchFinding", "RankTrace", "StragglerConfig", "StragglerFinding", "analyze", "load_paths",
    "normalize", "normalize_dumps",
]
