"""torchft's own Flight Recorder dumps: one folder per quorum.

torchft's Manager points ``TORCH_FR_DUMP_TEMP_FILE`` at ``<value>_quorum_<quorum_id>/<global_rank>``
at every new quorum, so a dump lands in the folder of the quorum it happened in. Quorums are
different incarnations of torchft's group: ``lightkeeper analyze`` reads one, the one whose dump
files are the newest unless told (docs/analyze.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

_QUORUM = re.compile(r"^(?P<prefix>.*)_quorum_(?P<quorum>-?\d+)$")


class SeveralJobs(ValueError):
    """A folder holding ``*_quorum_<id>`` folders of more than one prefix: several jobs' (or
    runs') quorums, whose ids say nothing about each other."""

    def __init__(self, parent: Path, found: dict[str, dict[int, Path]]) -> None:
        named = ", ".join(f"{p!r} ({len(q)} quorum{'s' if len(q) > 1 else ''})" for p, q in sorted(found.items()))
        super().__init__(f"torchft quorum folders of {len(found)} prefixes: {named}; which job's "
                         f"quorum is the newest would be a guess: give one prefix: {parent / min(found)}")


def quorum_folders(path: str | Path) -> dict[int, Path]:
    """quorum id -> folder, for ``path`` a folder holding ``*_quorum_<id>`` folders, or the
    prefix itself (the value of ``TORCH_FR_DUMP_TEMP_FILE``) beside which they lie; {} else.
    ``OSError`` when the folder to look in cannot be listed; :class:`SeveralJobs` when ``path``
    holds quorum folders of several prefixes."""
    p = Path(path)
    if not p.is_dir():
        return _by_prefix(p.parent).get(p.name, {}) if p.name and p.parent.is_dir() else {}
    inside = _by_prefix(p)
    if len(inside) > 1:
        raise SeveralJobs(p, inside)
    try:
        return next(iter(inside.values()), None) or (_by_prefix(p.parent).get(p.name, {}) if p.name else {})
    except OSError:  # a folder of dumps inside one this user may not list: read as given
        return {}


def _by_prefix(parent: Path) -> dict[str, dict[int, Path]]:
    """prefix -> quorum id -> folder, of ``parent``'s ``<prefix>_quorum_<id>`` folders."""
    out: dict[str, dict[int, Path]] = {}
    for c in parent.iterdir():
        m = _QUORUM.match(c.name)
        if m and c.is_dir():
            out.setdefault(m.group("prefix"), {})[int(m.group("quorum"))] = c
    return out


def pick(folders: dict[int, Path], quorum: int | None, held: dict[int, tuple[float, int]]) -> tuple[int, Path] | None:
    """The folder of ``quorum``, else of those holding a file (``held``: :func:`holdings`) the one
    whose files are the newest (ties: the higher id), else the newest quorum's; None when
    ``quorum`` is not there. By time, not id: a restarted Lighthouse counts quorum ids from 0
    again, so an older run's higher id would win."""
    if quorum is None:
        q = max(held, key=lambda q: (held[q][0], q)) if held else max(folders)
        return q, folders[q]
    return (quorum, folders[quorum]) if quorum in folders else None


def holdings(folders: dict[int, Path]) -> dict[int, tuple[float, int]]:
    """quorum id -> (newest mtime, count) of the files (:func:`listed`) of each folder holding
    one. A folder that cannot be listed holds one at its own mtime: reading it says why."""
    out: dict[int, tuple[float, int]] = {}
    for q, folder in folders.items():
        try:
            times = [p.stat().st_mtime for p in listed(folder)]
        except OSError:
            try:
                times = [folder.stat().st_mtime]
            except OSError:
                times = [0.0]
        if times:
            out[q] = (max(times), len(times))
    return out


def listed(folder: Path) -> Iterator[Path]:
    """The files in ``folder`` the loader reads: those whose names do not start with ``.``;
    ``OSError`` when it cannot be listed."""
    return (p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
