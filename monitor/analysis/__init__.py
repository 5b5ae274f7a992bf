"""Flight Recorder analysis across ranks: which collectives went wrong, which ranks are to blame.

Public API (pure functions, no I/O except the loader, no torch import):

- ``analyze(dumps, *, blame_missing=False, same_host=False, world_size=None, straggler=None)
  -> AnalysisResult``: ``dumps`` maps global rank -> dump dict (as ``/v1/fr_trace``,
  ``_dump_fr_trace_json``, ``_dump_nccl_trace_json`` or the pickled ``_dump_nccl_trace`` give
  it) or a pre-normalized ``RankTrace``. Cheap enough to call every second on live dumps.
- ``AnalysisResult``: ``.findings`` (``MismatchFinding`` / ``HangFinding`` /
  ``StragglerFinding``, each with ``.to_dict()``), ``.lags`` (kind ``lag``: a rank behind the
  one peer it was compared with, nothing else agreeing), ``.ranks``, ``.unknown_ranks``,
  ``.errors``,
  ``.last_seq`` (``GroupKey -> {rank: last enqueued seq}`` for every current group, i.e. the
  latest torchft incarnation), ``.to_dict()`` (the JSON of ``lightkeeper analyze --format json``).
- ``normalize(dump, rank=None) -> RankTrace`` and ``DumpFormatError``: one dump, validated;
  ``normalize_dumps(dumps) -> (traces, errors)``: every rank's, once (then pass the traces to
  ``analyze`` and to the queries below).
- ``load_paths(paths) -> LoadResult``: read per-rank dump files (JSON or pickle) from files and
  directories; unreadable files become errors instead of exceptions.

Finding kinds and the rules behind them are documented in :mod:`monitor.analysis.engine`; the
JSON interface in docs/analyze.md.
"""

from .engine import StragglerConfig, analyze, normalize_dumps
from .findings import AnalysisResult, Finding, HangFinding, MismatchFinding, StragglerFinding
from .loader import LoadResult, load_paths
from .model import DumpFormatError, GroupKey, RankTrace, normalize

__all__ = [
    "AnalysisResult",
    "DumpFormatError",
    "Finding",
    "GroupKey",
    "HangFinding",
    "LoadResult",
    "MismatchFinding",
    "RankTrace",
    "StragglerConfig",
    "StragglerFinding",
    "analyze",
    "load_paths",
    "normalize",
    "normalize_dumps",
]
