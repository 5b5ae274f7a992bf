"""Flight Recorder analysis across ranks: which collectives went wrong, which ranks are to blame.

Pure functions, no torch import, no I/O but the loader's:

- ``analyze(dumps, *, blame_missing=False, same_host=False, world_size=None, straggler=None)
  -> AnalysisResult``: global rank -> dump dict (``/v1/fr_trace``, ``_dump_*_json``, the pickled
  ``_dump_nccl_trace``) or a ``RankTrace``; ``.findings``, ``.lags``, ``.last_seq``, ``.to_dict()``
  (the JSON of ``lightkeeper analyze --format json``);
- ``normalize(dump, rank=None) -> RankTrace`` (raises ``DumpFormatError``) and
  ``normalize_dumps(dumps) -> (traces, errors)``: every rank's once, to pass to ``analyze``;
- ``load_paths(paths) -> LoadResult``: per-rank dump files (JSON or pickle), errors not raised.

The rules: :mod:`.engine` and :mod:`.stragglers`; the JSON interface: docs/analyze.md.
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
