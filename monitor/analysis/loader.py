"""Reading per-rank Flight Recorder dumps from disk.

:func:`load_paths` takes files and directories (every regular, non-hidden file directly inside):
JSON (``/v1/fr_trace``, torch's ``_dump_*_json``) and pickle (``TORCH_NCCL_DUMP_ON_TIMEOUT``'s
``<prefix><rank>``). The rank is the dump's ``rank`` key, else the digits ending the file name.
Each dump is normalized as soon as it is read (:mod:`.columnar`) and the raw dict dropped.

Inputs of at least :data:`POOL_MIN_BYTES` are loaded by worker processes (:mod:`.pool`), which
send back packed traces (:mod:`.wire`); smaller ones in this process. Both give the same result.

Pickles are read by the C reader (``_frpickle.c``, docs/stack.md) where it is built and not
turned off by ``LIGHTKEEPER_ANALYZE_PURE_PYTHON=1``; a file it refuses, and every pickle where
it is not used, by Python's unpickler with every class and function refused (a dump file must
not run code). Both give the same trace or the same error. A file that is truncated, corrupt,
of a foreign schema, without a rank, or a second dump of a loaded rank becomes an ``errors``
entry (``{"path": .., "error": ..}``); the others are still loaded.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .columnar import normalize_columnar, normalize_packed, normalize_parsed
from .model import DumpFormatError, RankTrace
from .pool import Outcome, available_cores, run_pool
from .wire import Packed, from_bytes, to_bytes

__all__ = ["LOAD_TASK", "POOL_MIN_BYTES", "LoadResult", "load_outcome", "load_packed", "load_paths",
           "pickle_reader", "read_dump", "rank_from_name"]

# Below this many bytes in all, loading here beats starting workers (bench_analyze.py --threshold).
POOL_MIN_BYTES = 8 << 20

LOAD_TASK = f"{__name__}:load_packed"  # the workers' task (run_pool imports it by name)

_TRAILING_DIGITS = re.compile(r"(\d+)(?:\.[A-Za-z]+)?$")

try:  # the C reader: an optional build (no compiler at install time: Python reads them all)
    from . import _frpickle
except ImportError:
    _frpickle = None  # type: ignore[assignment]

# C reader refusals Python's unpickler must not be given either: a memo index past the file's
# size makes it grow its memo to that index (gigabytes). Such a file is an error.
_NEVER_PICKLED = frozenset({"memo index out of range"})

PURE_PYTHON_ENV = "LIGHTKEEPER_ANALYZE_PURE_PYTHON"  # "1": Python's unpickler reads every pickle


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
            # from the buffered file, not a BytesIO: torch's protocol 2 has no frames, and
            # without peek the unpickler reads opcode by opcode through Python calls
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
    """``"c"`` when pickles are read by the C reader, else ``"python"``."""
    return "c" if _c_reader() is not None else "python"


def _c_reader() -> Any:
    if _frpickle is None or os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return None
    return _frpickle


def _load(path: str | Path, packed: bool) -> RankTrace | Packed:
    """The file's trace (``packed``: :class:`~.wire.Packed`), by the C reader where it reads
    the file, else by Python; raises what reading or normalizing raises."""
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
    raw = read_dump(path)
    rank = _rank_of(raw, path)
    return normalize_packed(raw, rank) if packed else normalize_columnar(raw, rank)


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
        return _load(path, packed=False), None
    except Exception as exc:  # a foreign pickle can fail in many ways; never crash on it
        return None, _describe(exc)


def load_packed(path: str | Path) -> Outcome:
    """The workers' task: :func:`load_outcome` with the trace packed and pickled
    (:func:`~.wire.to_bytes`), so that a compact trace crosses the pipe."""
    try:
        return to_bytes(_load(path, packed=True)), None  # type: ignore[arg-type]
    except Exception as exc:  # as load_outcome: a foreign pickle can fail in many ways
        return None, _describe(exc)


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
    # dumps and traces are many small containers without cycles: the cyclic GC would rescan
    # them over and over while they are built
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if jobs > 1 and len(files) > 1 and _total_size(files) >= POOL_MIN_BYTES:
            outcomes = _decoded(run_pool(files, jobs, LOAD_TASK))
        else:
            outcomes = list(map(load_outcome, files))
    finally:
        if was_enabled:
            gc.enable()
    for path, (trace, error) in zip(files, outcomes, strict=True):
        if trace is None:
            result.errors.append({"path": str(path), "error": error or "not loaded"})
        elif trace.rank in result.traces:
            error = f"duplicate dump of rank {trace.rank} (also {result.paths[trace.rank]})"
            result.errors.append({"path": str(path), "error": error})
        else:
            result.traces[trace.rank] = trace
            result.paths[trace.rank] = str(path)
    return result


def _decoded(sent: list[Outcome]) -> list[Outcome]:
    """The workers' pickled traces decoded once all are in (``wire.to_bytes`` says why), each
    pickle dropped as soon as its trace is made."""
    out: list[Outcome] = []
    for i, (blob, error) in enumerate(sent):
        sent[i] = (None, None)
        out.append((None if blob is None else from_bytes(blob), error))
    return out


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
