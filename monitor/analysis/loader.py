"""Reading per-rank Flight Recorder dumps from disk: :func:`load_paths`.
Pickles go to the C reader where built, else to an unpickler refusing every class (no code runs).
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .columnar import normalize, normalize_packed, normalize_parsed, rank_value
from .model import DumpFormatError, RankTrace
from .pool import Outcome, available_cores, file_size, run_pool
from .torchft_dumps import listed
from .wire import Packed, from_bytes, to_bytes

# Below this many bytes in all, loading here beats starting workers (bench_analyze.py --threshold).
POOL_MIN_BYTES = 8 << 20

LOAD_TASK = f"{__name__}:load_packed"  # the workers' task (run_pool imports it by name)

_TRAILING_DIGITS = re.compile(r"(\d+)(?:\.[A-Za-z]+)?$")

try:  # the C reader: an optional build (no compiler at install time: Python reads them all)
    from . import _frpickle
except ImportError:
    _frpickle = None  # type: ignore[assignment]

_MEMO_RANGE = "memo index out of range"
# refusals said at once: the Python path would refuse them too, more slowly
_NEVER_PICKLED = frozenset({_MEMO_RANGE})

PURE_PYTHON_ENV = "LIGHTKEEPER_ANALYZE_PURE_PYTHON"  # "1": Python's unpickler reads every pickle

# Tensor shapes are bounded before a dump is normalized: through a pickle's memo a few KB can
# name one list of ints a million times, and each signature copies and hashes what it names.
# torch records every tensor of a collective (no limit): a coalesced one may have thousands.
_SIZE_KEYS = ("input_sizes", "output_sizes")
MAX_TENSORS = 1 << 14  # per entry's input_sizes, or its output_sizes
MAX_DIMS = 64  # per tensor: CUDA's kernels take at most 25
MAX_SHAPE_INTS = 1 << 23  # tensors and dims of all of a dump's entries, each reference counted


@dataclass
class LoadResult:
    traces: dict[int, RankTrace] = field(default_factory=dict)
    paths: dict[int, str] = field(default_factory=dict)
    errors: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how the inputs were read, where it is not plain
    pickle_reader: str = "python"  # which reader read the pickles: pickle_reader()


class _DataOnlyUnpickler(pickle._Unpickler):
    """Python's own unpickler, not the C one: its memo is a dict, where the C one grows an array
    to the highest memo index a file names (11 bytes can ask for gigabytes). It reads what the
    C reader does not (odd files, or a build without it), so its speed matters less."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, size: int) -> None:
        super().__init__(file)
        self._in, self._size = file, size

    def load(self) -> Any:
        try:
            return super().load()
        except (IndexError, struct.error, ValueError) as exc:
            # an opcode's argument cut short: said as the C unpickler says it
            if self._in.tell() >= self._size:
                raise EOFError("Ran out of input") from exc
            raise pickle.UnpicklingError(str(exc) or type(exc).__name__) from exc

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a dump holds plain data only")

    def _memo_put(self, index: int) -> None:
        # the C reader's bound too: a pickler numbers its memo from 0, one per value it wrote
        if index < 0 or index > self._size:
            raise pickle.UnpicklingError(f"{_MEMO_RANGE}: not a pickle any pickler writes")
        self.memo[index] = self.stack[-1]

    def _put(self) -> None:
        self._memo_put(int(self.readline()[:-1]))

    def _binput(self) -> None:
        self._memo_put(self.read(1)[0])

    def _long_binput(self) -> None:
        self._memo_put(struct.unpack("<I", self.read(4))[0])

    dispatch[pickle.PUT[0]] = _put
    dispatch[pickle.BINPUT[0]] = _binput
    dispatch[pickle.LONG_BINPUT[0]] = _long_binput


def read_dump(path: str | Path) -> Any:
    """The decoded dump file (JSON or pickle); raises ``ValueError`` (:class:`DumpFormatError`
    when it is neither), ``pickle.UnpicklingError``, ``EOFError`` or ``OSError`` when it cannot
    be decoded."""
    with open(path, "rb") as f:
        if f.peek(1)[:1] == b"\x80":
            return _DataOnlyUnpickler(f, os.fstat(f.fileno()).st_size).load()
        data = f.read()
    if dump_kind(data) == "json":
        return json.loads(data)
    raise DumpFormatError(_what_else(data))


def dump_kind(head: bytes) -> str | None:
    """What a file beginning with ``head`` (its first 262 bytes tell) is: ``"json"``, ``"gzip"``,
    ``"tar"``, ``"pickle"``, the first that fits in that order (:func:`read_dump`'s, once it has
    unpickled any file whose byte 0 opens a pickle), else None. JSON and a pickle are told by their
    first byte after any whitespace; read_dump refuses whitespace before a pickle."""
    first = head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1]  # a UTF-8 BOM: json.loads reads past it
    if first in (b"{", b"["):
        return "json"
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head[257:262] == b"ustar":
        return "tar"
    return "pickle" if first == b"\x80" else None


def _what_else(data: bytes) -> str:
    """What a file that is neither JSON nor a pickle is, where that says what to do."""
    if not data:
        return "an empty file"
    kind = dump_kind(data)
    if kind == "gzip":  # not unpacked here: a small file can unpack to gigabytes
        return "gzip-compressed: gunzip it first"
    if kind == "tar":
        return "a tar archive, not an incident bundle: unpack it and give the folder"
    return "neither JSON nor a pickle"


def rank_from_name(path: str | Path) -> int | None:
    """The digits ending a file name (``rank12``, ``trace_rank_3.json``), else None."""
    match = _TRAILING_DIGITS.search(Path(path).name)
    return int(match.group(1)) if match else None


def _candidates(paths: Iterable[str | Path], errors: list[dict[str, str]], notes: list[str],
                prefix: str | None) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        try:
            is_dir = path.is_dir()
            found = sorted(listed(path)) if is_dir else []
        except OSError as exc:  # a folder this user may not list: said, and the others read
            errors.append(unreadable(path, exc))
            continue
        if is_dir:
            if prefix is not None:
                found = [p for p in found if p.name.startswith(prefix)]
            if not found:  # said in the report, JSON too: a script sees why it exits 2
                errors.append({"path": str(path), "error": "no dump file here" + (
                    f" named {prefix}*" if prefix is not None else "")})
                continue
            # a job's logs beside its dumps (train_rank0.log) name no job: only dump-like files do
            elif len(jobs := _prefixes(found)) > 1 and len(jobs := _prefixes(list(filter(_dump_like, found)))) > 1:
                if _overlap(jobs):  # two jobs' rank 0s: neither is "the" rank 0
                    named = ", ".join(f"{name!r} ({len(ranks)} files)" for name, ranks in jobs.items())
                    errors.append({"path": str(path), "error": f"dumps of {len(jobs)} jobs by their "
                                   f"file names: {named}; pick one with --prefix"})
                    continue
                # no rank under two names: one job's dumps named per host (node-a_..., node-b_...)
                named = ", ".join(f"{name!r} (ranks {_span(ranks)})" for name, ranks in jobs.items())
                notes.append(f"{path}: dumps under {len(jobs)} file name prefixes, no rank under two: "
                             f"read as one job: {named} (--prefix to read one)")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif path.exists():  # a FIFO, a device, a process substitution: not read
            errors.append({"path": str(path), "error": "not a regular file: not read"})
        else:
            errors.append({"path": str(path), "error": "no such file or directory"})
    return files


def unreadable(path: str | Path, exc: OSError) -> dict[str, str]:
    """The ``errors`` entry of a PATH that could not be listed or looked at (``exc``)."""
    what = f"cannot read {exc.filename}" if exc.filename and str(exc.filename) != str(path) else "cannot read it"
    return {"path": str(path), "error": f"{what}: {exc.strerror or type(exc).__name__}"}


def _prefixes(files: list[Path]) -> dict[str, list[int]]:
    """The rank digits of the files sharing each name before them (``nccl_trace_rank_``: 0..7),
    for names two or more files share: torch names a job's dumps ``<TORCH_FR_DUMP_TEMP_FILE><rank>``."""
    found: dict[str, list[int]] = {}
    for p in files:
        match = _TRAILING_DIGITS.search(p.name)
        if match:
            found.setdefault(p.name[:match.start()], []).append(int(match.group(1)))
    return {name: ranks for name, ranks in found.items() if len(ranks) > 1}


def _dump_like(path: Path) -> bool:
    """Whether the file begins as a dump does (a pickle, JSON) or as a packed one (gzip, tar)."""
    try:
        with open(path, "rb") as f:
            head = f.read(262)
    except OSError:
        return True  # said when read; counted here, as before
    return dump_kind(head) is not None


def _overlap(jobs: dict[str, list[int]]) -> bool:
    """Some rank number under two of the names."""
    sets = [set(ranks) for ranks in jobs.values()]
    return sum(map(len, sets)) > len(set().union(*sets))


def _span(ranks: list[int]) -> str:
    ranks = sorted(set(ranks))
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 and ranks[-1] - ranks[0] == len(ranks) - 1 else \
        ", ".join(map(str, ranks))


def pickle_reader() -> str:
    """``"c"`` when pickles are read by the C reader, else ``"python"``."""
    return "c" if _c_reader() is not None else "python"


def _c_reader() -> Any:
    return None if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0") else _frpickle


def _load(path: str | Path, packed: bool) -> RankTrace | Packed:
    reader = _c_reader()
    if reader is not None:
        with open(path, "rb") as f:
            data = f.read() if f.peek(1)[:1] == b"\x80" else None
        if data is not None:
            try:
                return normalize_parsed(_Bounded(reader.parse(data)), lambda raw: _rank_of(raw, path),
                                        packed)
            except reader.DumpRefused as exc:
                if str(exc) in _NEVER_PICKLED:
                    raise pickle.UnpicklingError(f"{exc}: not a pickle any pickler writes") from None
            except MemoryError:
                pass  # either way Python's unpickler decides
    raw = read_dump(path)
    _check_dump(raw)
    rank = _rank_of(raw, path)
    return normalize_packed(raw, rank) if packed else normalize(raw, rank)


class _Bounded:
    """The C reader's parsed dump, its entries' shapes checked (:func:`check_shapes`) once built,
    as Python's path checks them."""

    def __init__(self, doc: Any) -> None:
        self._doc = doc

    def columns(self, keys: tuple[str, ...], optional: str) -> Any:
        got = self._doc.columns(keys, optional)
        if got is not None:
            check_shapes([got[1][keys.index(k)] for k in _SIZE_KEYS])
        return got

    def load(self) -> Any:
        dump = self._doc.load()
        _check_dump(dump)
        return dump


def _check_dump(dump: Any) -> None:
    entries = dump.get("entries") if isinstance(dump, dict) else None
    if isinstance(entries, list):  # what is not a dict is normalize's to refuse
        check_shapes([[e.get(k) if isinstance(e, dict) else None for e in entries]
                      for k in _SIZE_KEYS])


def check_shapes(columns: list[Sequence[Any]]) -> None:
    """Raises :class:`DumpFormatError` where an entry's sizes (``columns``: input_sizes, then
    output_sizes, one value per entry) pass MAX_TENSORS or MAX_DIMS, or all of them together
    MAX_SHAPE_INTS. Values that are no list of shapes are left to normalize."""
    left = MAX_SHAPE_INTS
    for key, column in zip(_SIZE_KEYS, columns, strict=True):
        for i, sizes in enumerate(column):
            if not isinstance(sizes, list | tuple):
                continue
            if len(sizes) > MAX_TENSORS:
                raise DumpFormatError(f"entry {i}: {len(sizes)} tensors in its {key}, over the "
                                      f"limit of {MAX_TENSORS}")
            dims = [len(s) if isinstance(s, list | tuple) else 1 for s in sizes]
            if dims and max(dims) > MAX_DIMS:
                raise DumpFormatError(f"entry {i}: a tensor of {max(dims)} dims in its {key}, "
                                      f"over the limit of {MAX_DIMS}")
            left -= len(dims) + sum(dims)
            if left < 0:
                raise DumpFormatError(f"entry {i}: past the limit of {MAX_SHAPE_INTS} tensors "
                                      "and dims in all entries' sizes (each reference counted)")


def _rank_of(raw: Any, path: str | Path) -> int:
    rank = rank_value(raw.get("rank") if isinstance(raw, dict) else None)
    if rank is None:
        rank = rank_from_name(path)
    if rank is None:
        key = "a null 'rank'" if isinstance(raw, dict) and "rank" in raw else "no 'rank' key"
        raise DumpFormatError(f"no rank: {key} and no digits ending the file name")
    return rank


def load_outcome(path: str | Path, packed: bool = False) -> Outcome:
    """``(trace, None)`` for a usable dump file, ``(None, error message)`` for any other;
    ``packed``: the trace packed and pickled (:func:`~.wire.to_bytes`)."""
    try:
        trace = _load(path, packed)
        return (to_bytes(trace) if packed else trace), None  # type: ignore[arg-type]
    except Exception as exc:  # a foreign pickle can fail in many ways; never crash on it
        return None, _describe(exc)


def load_packed(path: str | Path) -> Outcome:
    """The workers' task: a compact trace crosses the pipe."""
    return load_outcome(path, packed=True)


def load_paths(paths: Iterable[str | Path], jobs: int | None = None, prefix: str | None = None) -> LoadResult:
    """Every dump under ``paths``, failures as ``errors``; ``jobs``: worker processes (default: the
    cores available; 1: none), ``ValueError`` when < 1. A directory's files are those named
    ``prefix``... when given; else two name prefixes sharing a rank number (two jobs' dumps) are an
    error, and prefixes without one are read as one job (said in ``notes``)."""
    result = LoadResult(pickle_reader=pickle_reader())
    files = _candidates(paths, result.errors, result.notes, prefix)
    jobs = available_cores() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    outcomes: Iterable[Outcome]
    # many small containers without cycles: the cyclic GC would rescan them while they are built
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
    # each pickle dropped as soon as its trace is made
    out: list[Outcome] = []
    for i, (blob, error) in enumerate(sent):
        sent[i] = (None, None)
        out.append((None if blob is None else from_bytes(blob), error))
    return out


def _total_size(files: list[Path]) -> int:
    return sum(map(file_size, files))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return "truncated file (unexpected end of data)"
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON: {exc}"
    if isinstance(exc, pickle.UnpicklingError):
        return f"invalid pickle: {exc}"
    if isinstance(exc, DumpFormatError):
        return str(exc)
    if isinstance(exc, MemoryError):  # its message is empty
        return "out of memory reading it (a pickle may declare a string of any size)"
    return f"{type(exc).__name__}: {exc}"
