"""Reading per-rank Flight Recorder dumps from disk.

:func:`load_paths` accepts files and directories (every regular, non-hidden file directly inside
is a candidate): JSON (as served by the WorkerServer's ``/v1/fr_trace`` or written from torch's
``_dump_*_json``) and pickle (as ``TORCH_NCCL_DUMP_ON_TIMEOUT`` writes ``<prefix><rank>``). The
rank is the dump's own ``rank`` key, else the digits that end the file name (before an
extension). Each dump is normalized as soon as it is read and the raw dict dropped, so memory
holds one raw dump at a time.

Pickles are read with an unpickler that refuses every class and function: Flight Recorder dumps
are plain dicts, lists, strings and numbers, and a dump file must not be able to run code. A file
that is truncated, corrupt, not JSON or pickle, of a foreign schema, without a rank, or a second
dump of a rank already loaded becomes an ``errors`` entry (``{"path": .., "error": ..}``); the
others are still loaded.
"""

from __future__ import annotations

import gc
import io
import json
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model import DumpFormatError, RankTrace, normalize

__all__ = ["LoadResult", "load_paths", "read_dump", "rank_from_name"]

_TRAILING_DIGITS = re.compile(r"(\d+)(?:\.[A-Za-z]+)?$")


@dataclass
class LoadResult:
    """Normalized traces by rank, the file each came from, and the files that failed."""

    traces: dict[int, RankTrace] = field(default_factory=dict)
    paths: dict[int, str] = field(default_factory=dict)
    errors: list[dict[str, str]] = field(default_factory=list)


class _DataOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a dump holds plain data only")


def read_dump(path: str | Path) -> Any:
    """The decoded content of one dump file (JSON or pickle, told apart by the first byte).

    Raises ``ValueError`` (incl. ``json.JSONDecodeError``), ``pickle.UnpicklingError``,
    ``EOFError`` or ``OSError`` when it cannot be decoded.
    """
    data = Path(path).read_bytes()
    head = data[:1]
    if head == b"\x80":
        return _DataOnlyUnpickler(io.BytesIO(data)).load()
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


def load_paths(paths: Iterable[str | Path]) -> LoadResult:
    """Load and normalize every dump under ``paths``; failures become ``errors`` entries."""
    result = LoadResult()
    files = _candidates(paths, result.errors)
    # a dump is hundreds of thousands of small containers: the cyclic GC would rescan them
    # over and over while they are built, for nothing (they hold no cycles)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for path in files:
            try:
                raw = read_dump(path)
                rank = raw.get("rank") if isinstance(raw, dict) else None
                if not isinstance(rank, int) or isinstance(rank, bool):
                    rank = rank_from_name(path)
                if rank is None:
                    raise DumpFormatError("no rank: no 'rank' key and no digits ending the file name")
                trace = normalize(raw, rank)
                del raw
            except (DumpFormatError, ValueError, pickle.UnpicklingError, EOFError, OSError) as exc:
                result.errors.append({"path": str(path), "error": _describe(exc)})
                continue
            except Exception as exc:  # a foreign pickle can fail in many ways; never crash on it
                result.errors.append({"path": str(path), "error": _describe(exc)})
                continue
            if trace.rank in result.traces:
                result.errors.append(
                    {"path": str(path), "error": f"duplicate dump of rank {trace.rank} (also {result.paths[trace.rank]})"}
                )
                continue
            result.traces[trace.rank] = trace
            result.paths[trace.rank] = str(path)
    finally:
        if gc_was_enabled:
            gc.enable()
    return result


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
