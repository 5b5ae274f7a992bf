"""torchft's own Flight Recorder dumps: one folder per quorum.

torchft's Manager (0.2.0 and nightly), when ``TORCH_FR_DUMP_TEMP_FILE`` is set, points it at
``<TORCH_FR_DUMP_TEMP_FILE>_quorum_<quorum_id>/<global_rank>`` at every new quorum
(``Manager._update_fr_path``; global rank: the replica id's trailing number x group size + group
rank). With ``TORCH_FR_DUMP_DYNAMIC_FILE_NAME=1`` torch writes each dump (a timeout, or an abort
with ``TORCHFT_TRIGGER_FR_ON_ABORT=true``) to that path as it is then, so into the folder of the
quorum it happened in; without it torch appends its own rank and keeps the path of a process's
first dump. Dumps of different quorums are different incarnations of torchft's group:
``lightkeeper analyze`` reads one quorum's folder at a time (the newest unless told), and
:func:`settle` makes what torch wrote there one job's ranks or says why it cannot.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from .model import GroupKey, RankTrace

_QUORUM = re.compile(r"^(?P<prefix>.*)_quorum_(?P<quorum>-?\d+)$")


def quorum_folders(path: str | Path) -> dict[int, Path]:
    """quorum id -> folder, for ``path`` a folder holding ``*_quorum_<id>`` folders, or the
    prefix itself (the value of ``TORCH_FR_DUMP_TEMP_FILE``) beside which they lie; {} else.
    ``OSError`` when the folder to look in cannot be listed."""
    p = Path(path)
    if not p.is_dir():
        return _folders(p.parent, p.name) if p.name and p.parent.is_dir() else {}
    inside = _folders(p, None)
    try:
        return inside or (_folders(p.parent, p.name) if p.name else {})
    except OSError:  # a folder of dumps inside one this user may not list: read as given
        return {}


def _folders(parent: Path, prefix: str | None) -> dict[int, Path]:
    """quorum id -> folder, of ``parent``'s ``<prefix>_quorum_<id>`` folders (any prefix: None)."""
    out = {}
    for c in parent.iterdir():
        m = _QUORUM.match(c.name)
        if c.is_dir() and m and prefix in (None, m.group("prefix")):
            out[int(m.group("quorum"))] = c
    return out


def pick(folders: dict[int, Path], quorum: int | None) -> tuple[int, Path] | None:
    """The folder of ``quorum``, else the newest quorum's; None when ``quorum`` is not there."""
    if quorum is None:
        q = max(folders)
        return q, folders[q]
    return (quorum, folders[quorum]) if quorum in folders else None


def settle(traces: dict[int, RankTrace], paths: dict[int, str], folder: str | Path) -> tuple[list[str], list[dict[str, str]]]:
    """The dumps loaded from torchft's quorum ``folder`` made one job's, in place: ``(notes,
    errors)``; a dump whose rank or replica group cannot be told is dropped with an error.

    torch writes these files itself, without a ``rank`` key: the rank is the file name, which
    torchft makes ``<global_rank>`` (replica id's trailing number x group size + group rank), to
    which torch appends its own rank unless ``TORCH_FR_DUMP_DYNAMIC_FILE_NAME=1``.
    """
    folder = Path(folder)
    mine = sorted(r for r, p in paths.items() if Path(p).parent == folder)
    if not mine:
        return [], []
    dup = sorted({m for r in mine for ms in traces[r].members.values() for m in ms if ms.count(m) > 1})
    if dup:  # torchft's global rank is group rank alone: every group's rank r wrote file r
        for r in mine:
            del traces[r], paths[r]
        return [], [{"path": str(folder), "error": (
            f"torchft gave several replica groups the same global rank(s) {_span(dup)} (their replica "
            "ids do not end in distinct numbers), so their dumps share file names here and each file "
            "holds whichever group wrote it last: which replica group a dump is from cannot be told; "
            "not read (give replica ids distinct trailing numbers, or each group its own "
            "TORCH_FR_DUMP_TEMP_FILE)")}]
    notes, errors = _rename(traces, paths, mine, folder)
    mine = sorted(r for r, p in paths.items() if Path(p).parent == folder)
    notes += _scope(traces, mine, errors, folder)
    return notes, errors


def _lists(trace: RankTrace) -> list[tuple[int, ...]]:
    return [ms for ms in trace.members.values() if ms]


def _rename(traces: dict[int, RankTrace], paths: dict[int, str], mine: list[int],
            folder: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Ranks of files torch named ``<global_rank><its rank>``: a name that is no member of its
    dump's own groups shows it, and then every name of the folder is split (one setting)."""
    named = [r for r in mine if Path(paths[r]).name.isdigit() and _lists(traces[r])]
    if all(any(r in ms for ms in _lists(traces[r])) for r in named):
        return [], []
    old = {r: (traces.pop(r), paths.pop(r)) for r in named}
    errors: list[dict[str, str]] = []
    for trace, path in old.values():
        name = Path(path).name
        fits = sorted({int(name[:i]) for i in range(1, len(name)) if name[i] != "0" or i == len(name) - 1}
                      & {m for ms in _lists(trace) for m in ms})
        if len(fits) != 1:
            errors.append({"path": path, "error": "cannot tell its rank: its name is torchft's global rank "
                           "followed by torch's rank, and " + (f"{' or '.join(map(str, fits))} could each be the "
                           "global rank" if fits else "no split of it is a member of its own groups")})
        elif fits[0] in traces:
            errors.append({"path": path, "error": f"duplicate dump of rank {fits[0]} (also {paths[fits[0]]})"})
        else:
            traces[fits[0]], paths[fits[0]] = replace(trace, rank=fits[0]), path
    note = ("file names are torchft's global rank followed by torch's own rank "
            "(TORCH_FR_DUMP_DYNAMIC_FILE_NAME unset), read as the global rank; torch then keeps the "
            f"path of a process's first dump, so a file in {folder.name} may hold a later dump of "
            "that process, of a later quorum too, written over its first")
    return [note], errors


def _scope(traces: dict[int, RankTrace], mine: list[int], errors: list[dict[str, str]], folder: Path) -> list[str]:
    """Groups torch numbers within each replica group (its own world: the default group lists
    ranks 0..n-1 in every group) keyed by replica group, their members made global ranks."""
    local = {k.pg for r in mine for k, ms in traces[r].members.items()
             if ms and r not in ms and k.pg and k.replica_group is None and k.quorum_id is None}
    if not local:
        return []
    lists = {ms for r in mine for k, ms in traces[r].members.items() if k.pg in local and k.replica_group is None}
    n = 1 + max(max(ms) for ms in lists)
    names = ", ".join(map(repr, sorted(local)))
    # no world's default group (0..n-1; a corrupt list may hold any number): the size is a guess
    if not (n >= 1 and any(len(ms) == n and ms == tuple(range(n)) for ms in lists)):
        for r in mine:
            t = traces[r]
            traces[r] = replace(t, groups={k: g for k, g in t.groups.items() if k.pg not in local},
                                members={k: ms for k, ms in t.members.items() if k.pg not in local})
        errors.append({"path": str(folder), "error": f"groups {names} number ranks within each replica "
                       "group, and no dump says the group size: not compared across dumps"})
        return []
    for r in mine:
        t, d = traces[r], r // n

        def scoped(k: GroupKey, d: int = d) -> GroupKey:
            return k._replace(replica_group=d) if k.pg in local and k.replica_group is None else k

        traces[r] = replace(t, groups={scoped(k): g for k, g in t.groups.items()},
                            members={scoped(k): tuple(m + d * n for m in ms) if scoped(k) != k else ms
                                     for k, ms in t.members.items()})
    groups = sorted({r // n for r in mine})
    return [f"dumps of {len(groups)} replica group(s) ({_span(groups)}) are here; groups {names} number "
            f"ranks within each replica group (of {n}): read as replica group global_rank // {n}'s, "
            "never compared across replica groups"]


def _span(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
