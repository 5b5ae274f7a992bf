"""Reading per-rank Flight Recorder dumps from disk.

:func:`load_paths` accepts files and directories (every regular, non-hidden file directly inside
is a candidate): JSON (as served by the WorkerServer's ``/v1/fr_trace`` or written from torch's
``_dump_*_json``) and pickle (as ``TORCH_NCCL_DUMP_ON_TIMEOUT`` writes ``<prefix><rank>``). The
rank is the dump's own ``rank`` key, else the digits that end the file name (before an
extension). Each dump is normalized as soon as it is read (:mod:`monitor.analysis.columnar`'s
fast path, same result as ``normalize``) and the raw dict dropped, so a process holds one raw
dump at a time.

Large inputs are loaded by worker processes (:mod:`monitor.analysis.pool`), one per available
core unless ``jobs`` says otherwise; inputs under :data:`POOL_MIN_BYTES` in all are loaded in
this process, where starting workers would cost more than it saves. Both ways give the same
result: the workers run :func:`load_packed` (the trace :func:`load_outcome` gives, packed for
the trip back straight from the dump's columns and pickled, :mod:`monitor.analysis.wire`; this
process decodes the traces once all are in), and files are taken in the same order for ranks
and duplicates.

Pickles are read by the C reader (``_frpickle``, built from ``_frpickle.c`` where a compiler
was there at install time; :func:`pickle_reader` says whether it is used, and
``LIGHTKEEPER_ANALYZE_PURE_PYTHON=1`` turns it off): it parses the bytes itself and builds only
the entries' fields the analysis reads (:func:`~monitor.analysis.columnar.normalize_parsed`),
and refuses anything but data opcodes. A file it refuses, and every pickle where it is not
used, is read by Python's unpickler with a subclass that refuses every class and function:
Flight Recorder dumps are plain dicts, lists, strings and numbers, and a dump file must not be
able to run code. Both readers give the same trace, or the same error. A file
that is truncated, corrupt, not JSON or pickle, of a foreign schema, without a rank, or a second
dump of a rank already loaded becomes an ``errors`` entry (``{"path": .., "error": ..}``); the
others are still loaded.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .columnar import normalize_columnar, normalize_packed, normalize_parsed
from .model import DumpFormatError, RankTrace
from .pool import Outcome, available_cores, run_pool
from .wire import Packed, from_bytes, to_bytes

__all__ = [
    "LOAD_TASK",
    "POOL_MIN_BYTES",
    "READ_TASK",
    "LoadResult",
    "load_file",
    "load_outcome",
    "load_packed",
    "load_paths",
    "pickle_reader",
    "read_dump",
    "read_outcome",
    "rank_from_name",
]

# Below this many bytes of dump files in all, loading in this process beats starting workers
# (measured: benchmarks/bench_analyze.py --threshold; docs/analyze.md, Performance).
POOL_MIN_BYTES = 8 << 20

# the worker pool's tasks (run_pool imports them by name in each worker)
LOAD_TASK = f"{__name__}:load_packed"
READ_TASK = f"{__name__}:read_outcome"

_TRAILING_DIGITS = re.compile(r"(\d+)(?:\.[A-Za-z]+)?$")

try:  # the C reader (monitor/analysis/_frpickle.c): an optional build, see pickle_reader()
    from . import _frpickle
except ImportError:  # not built (no compiler at install time): Python's unpickler reads them all
    _frpickle = None  # type: ignore[assignment]

# Refusals of the C reader for bytes no pickler writes, which Python's unpickler must not be given
# either: a memo index past the file's size makes it grow its memo to that index (a LONG_BINPUT
# of 2**31: gigabytes, tens of seconds). Such a file is an error, as a truncated one is.
_NEVER_PICKLED = frozenset({"memo index out of range"})

# set to 1 to read every pickle with Python's unpickler even where the C reader is built (the
# tests and benchmarks/bench_analyze.py compare the two)
PURE_PYTHON_ENV = "LIGHTKEEPER_ANALYZE_PURE_PYTHON"


@dataclass
class LoadResult:
    """Normalized traces by rank, the file each came from, and the files that failed."""

    traces: dict[int, RankTrace] = field(default_factory=dict)
    paths: dict[int, str] = field(default_factory=dict)
    errors: list[dict[str, str]] = field(default_factory=list)
    pickle_reader: str = "python"  # which reader read the pickles: pickle_reader()


class _DataOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a dump holds plain data only")


def read_dump(path: str | Path) -> Any:
    """The decoded content of one dump file (JSON or pickle, told apart by the first byte).

    Raises ``ValueError`` (incl. ``json.JSONDecodeError``), ``pickle.UnpicklingError``,
    ``EOFError`` or ``OSError`` when it cannot be decoded.
    """
    with open(path, "rb") as f:
        if f.peek(1)[:1] == b"\x80":
            # from the buffered file itself, not from bytes in a BytesIO: torch writes protocol 2,
            # without frames, and without a file that can peek the unpickler reads it opcode by
            # opcode through Python calls (3 to 4 times slower)
            return _DataOnlyUnpickler(f).load()
        data = f.read()
    if data.lstrip()[:1] in (b"{", b"["):
        return json.loads(data)
    raise ValueError("neither JSON nor a pickle")


def rank_from_name(path: str | Path) -> int | None:
    """The digits that end a file name (``rank12``, ``nccl_trace_rank_3.json``), else None."""
    match = _TRAILING_DIGITS.search(Path(path).name)
    return int(match.group(1)) if match else None


def _candidates(paths: Iterable[str | Path], errors: list[dict[str, str]]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")))
        elif path.is_file():
            files.append(path)
        else:
            errors.append({"path": str(path), "error": "no such file or directory"})
    return files


def pickle_reader() -> str:
    """``"c"`` when pickle dumps are read by the C reader (built, and not turned off by
    ``LIGHTKEEPER_ANALYZE_PURE_PYTHON=1``), else ``"python"``. A file the C reader refuses (an
    opcode or a shape it does not read) is read by Python's unpickler either way."""
    return "c" if _c_reader() is not None else "python"


def _c_reader() -> Any:
    if _frpickle is None or os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return None
    return _frpickle


def load_file(path: str | Path) -> RankTrace:
    """Read and normalize one dump file; raises what reading or normalizing raises."""
    return _load(path, packed=False)  # type: ignore[return-value]


def _load(path: str | Path, packed: bool) -> RankTrace | Packed:
    """The file's trace (``packed``: as :func:`~monitor.analysis.columnar.normalize_packed`
    gives it): by the C reader where it reads the file, else as Python reads it. Both give
    the same trace and raise the same errors."""
    reader = _c_reader()
    if reader is not None:
        with open(path, "rb") as f:
            data = f.read() if f.peek(1)[:1] == b"\x80" else None
        if data is not None:
            try:
                return normalize_parsed(reader.parse(data), lambda raw: _rank_of(raw, path), packed)
            except reader.DumpRefused as exc:
                if str(exc) in _NEVER_PICKLED:
                    raise pickle.UnpicklingError(f"{exc}: not a pickle any pickler writes") from None
                # otherwise not what it reads: Python's unpickler decides
            except MemoryError:
                pass  # a dump it cannot build: Python's unpickler decides
    raw, rank = _read_ranked(path)
    return normalize_packed(raw, rank) if packed else normalize_columnar(raw, rank)


def _read_ranked(path: str | Path) -> tuple[Any, int]:
    """The decoded dump and its rank (its own ``rank`` key, else the file name's)."""
    raw = read_dump(path)
    return raw, _rank_of(raw, path)


def _rank_of(raw: Any, path: str | Path) -> int:
    rank = raw.get("rank") if isinstance(raw, dict) else None
    if not isinstance(rank, int) or isinstance(rank, bool):
        rank = rank_from_name(path)
    if rank is None:
        raise DumpFormatError("no rank: no 'rank' key and no digits ending the file name")
    return rank


def load_outcome(path: str | Path) -> Outcome:
    """``(trace, None)`` for a usable dump file, ``(None, error message)`` for any other."""
    try:
        return load_file(path), None
    except Exception as exc:  # a foreign pickle can fail in many ways; never crash on it
        return None, _describe(exc)


def load_packed(path: str | Path) -> Outcome:
    """:func:`load_outcome` with the trace packed (:func:`monitor.analysis.wire.pack`; made
    straight from the dump's columns, :func:`~monitor.analysis.columnar.normalize_packed`) and
    pickled (:func:`~monitor.analysis.wire.to_bytes`): the workers' task, so that a compact
    trace crosses the pipe; :func:`~monitor.analysis.wire.from_bytes` gives the trace back."""
    try:
        return to_bytes(_load(path, packed=True)), None  # type: ignore[arg-type]
    except Exception as exc:  # as load_outcome: a foreign pickle can fail in many ways
        return None, _describe(exc)


def read_outcome(path: str | Path) -> Outcome:
    """Read and decode one file as the loader does, then drop it: ``(None, None)``, or ``(None,
    error message)``. The cost of reading alone, which ``benchmarks/bench_analyze.py`` measures
    as the load floor (``run_pool(files, jobs, READ_TASK)``)."""
    try:
        read_dump(path)
    except Exception as exc:  # a foreign file can fail in many ways
        return None, _describe(exc)
    return None, None


def load_paths(paths: Iterable[str | Path], jobs: int | None = None) -> LoadResult:
    """Load and normalize every dump under ``paths``; failures become ``errors`` entries.

    ``jobs``: worker processes (default: the cores this process may use); 1 loads everything
    in this process. Inputs under :data:`POOL_MIN_BYTES` are loaded in this process anyway.
    """
    result = LoadResult(pickle_reader=pickle_reader())
    files = _candidates(paths, result.errors)
    jobs = available_cores() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    outcomes: Iterable[Outcome]
    with _no_cyclic_gc():
        if jobs > 1 and len(files) > 1 and _total_size(files) >= POOL_MIN_BYTES:
            outcomes = _decoded(run_pool(files, jobs, LOAD_TASK))
        else:
            outcomes = list(map(load_outcome, files))
    for path, (trace, error) in zip(files, outcomes, strict=True):
        if trace is None:
            result.errors.append({"path": str(path), "error": error or "not loaded"})
        elif trace.rank in result.traces:
            result.errors.append(
                {"path": str(path), "error": f"duplicate dump of rank {trace.rank} (also {result.paths[trace.rank]})"}
            )
        else:
            result.traces[trace.rank] = trace
            result.paths[trace.rank] = str(path)
    return result


def _decoded(sent: list[Outcome]) -> list[Outcome]:
    """The workers' pickled traces decoded once all are in, in one loop (``wire.to_bytes`` says
    why), each pickle dropped as soon as its trace is made."""
    out: list[Outcome] = []
    for i, (blob, error) in enumerate(sent):
        sent[i] = (None, None)
        out.append((None if blob is None else from_bytes(blob), error))
    return out


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    # a dump is hundreds of thousands of small containers, and the traces the workers send
    # back thousands more: the cyclic GC would rescan them over and over while they are built,
    # for nothing (they hold no cycles)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _total_size(files: list[Path]) -> int:
    total = 0
    for path in files:
        try:
            total += os.stat(path).st_size
        except OSError:  # it will fail to load, and say why, like any other
            pass
    return total


def _describe(exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return "truncated file (unexpected end of data)"
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON: {exc}"
    if isinstance(exc, pickle.UnpicklingError):
        return f"invalid pickle: {exc}"
    if isinstance(exc, DumpFormatError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
