"""torchft's own Flight Recorder dumps: one folder per quorum.

torchft's Manager points ``TORCH_FR_DUMP_TEMP_FILE`` at ``<value>_quorum_<quorum_id>/<global_rank>``
at every new quorum, so a dump lands in the folder of the quorum it happened in. Quorums are
different incarnations of torchft's group: ``lightkeeper analyze`` reads one, the newest holding a
dump unless told (docs/analyze.md).
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


def pick(folders: dict[int, Path], quorum: int | None) -> tuple[int, Path] | None:
    """The folder of ``quorum``, else the newest quorum's holding a file (the newest when none
    does); None when ``quorum`` is not there. The Manager makes a folder at every quorum and a
    dump lands only where a collective failed, so the newest is normally empty."""
    if quorum is None:
        q = next((q for q in sorted(folders, reverse=True) if holds_files(folders[q])), max(folders))
        return q, folders[q]
    return (quorum, folders[quorum]) if quorum in folders else None


def holds_files(folder: Path) -> bool:
    """Whether ``folder`` holds a file the loader would read (:func:`listed`); True when it
    cannot be listed: reading it says why."""
    try:
        return any(listed(folder))
    except OSError:
        return True


def listed(folder: Path) -> Iterator[Path]:
    """The files in ``folder`` the loader reads: those whose names do not start with ``.``;
    ``OSError`` when it cannot be listed."""
    return (p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
