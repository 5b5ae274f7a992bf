"""Flight Recorder analysis across ranks: which collectives went wrong, which ranks are to blame.

Pure functions, no torch: ``analyze(dumps) -> AnalysisResult`` (global rank -> dump dict or
``RankTrace``), ``normalize`` (raises ``DumpFormatError``), ``normalize_dumps`` and
``load_paths`` (per-rank dump files; errors listed, not raised). The rules and the JSON
interface: docs/analyze.md.
"""

from .engine import analyze, normalize_dumps
from .findings import AnalysisResult, Finding, HangFinding, MismatchFinding, StragglerFinding
from .loader import LoadResult, load_paths
from .model import DumpFormatError, GroupKey, RankTrace, normalize
from .stragglers import StragglerConfig

__all__ = [
    "AnalysisResult", "DumpFormatError", "Finding", "GroupKey", "HangFinding", "LoadResult",
    "MismatchFinding", "RankTrace", "StragglerConfig", "StragglerFinding", "analyze", "load_paths",
    "normalize", "normalize_dumps",
]
