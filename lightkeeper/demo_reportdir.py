"""``lightkeeper demo --report-dir``: a directory the demo may make and write, checked before
the run starts and again as it is made; as root, one only root (or the user who ran sudo) may
change, since root's spare hosts run what they read there."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def check_report_dir(given: str | None) -> Path | None:
    """``--report-dir`` as a path the demo can create or write, or ValueError saying why not;
    nothing is created yet. One that holds a run already is refused: its monitor would reopen
    that run's audit log and quarantines."""
    if given is None:
        return None
    path = Path(given).resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{given}: not a directory")
    held = [n for n in ("report.json", "monitor.sqlite") if (path / n).exists()]
    if held:
        raise ValueError(f"{given}: holds a run already ({', '.join(held)}); give a new or "
                         "empty directory")
    base = next(p for p in (path, *path.parents) if p.exists())
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):  # EROFS too
        raise ValueError(f"{given}: cannot write in {base}")
    _check_parents(path, given)
    if path.exists():
        _check_owner(path.stat(), given)
    return path


def _check_owner(st: os.stat_result, given: str | Path) -> None:
    """As root, ValueError unless ``st`` is a directory root owns that no one else may write in:
    root's spare hosts read what to run from files in it."""
    if os.geteuid() == 0 and (not stat.S_ISDIR(st.st_mode) or st.st_uid != 0
                              or st.st_mode & 0o022):
        raise ValueError(f"{given}: a directory another user owns or may write in; as root "
                         "the demo runs what it reads there: give one of root's")


def _check_parents(path: Path, given: str | Path) -> None:
    """As root, ValueError naming the first directory above ``path`` (those that exist, up to
    /) that root, or the user who ran sudo, does not own, or that others may write in without
    the sticky bit (/tmp has it): whoever may could move ``path`` away and put their own
    directory or a link in its place."""
    if os.geteuid() != 0:
        return
    sudo = os.environ.get("SUDO_UID", "")
    ours = {0, int(sudo)} if sudo.isdigit() else {0}  # `sudo ... --report-dir ~/x` works
    for parent in path.parents:
        try:
            st = parent.lstat()  # ``path`` is resolved: a link here was put in since
        except (FileNotFoundError, NotADirectoryError):
            continue  # made by the demo, root's
        if not stat.S_ISDIR(st.st_mode):
            why = "is no directory (a link?)"
        elif st.st_uid not in ours:
            why = f"is owned by another user (uid {st.st_uid})"
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            why = "may be written in by group or others (and has no sticky bit)"
        else:
            continue
        raise ValueError(f"{given}: {parent} {why}; as root the demo runs what it reads in "
                         "the report directory: give one under directories only root"
                         + (" or you" if len(ours) > 1 else "") + " may change")


def make_report_dir(path: Path) -> None:
    """Create ``--report-dir`` (0o700), or take the one there, and look at it again: since
    :func:`check_report_dir` looked, another user may have made it or put a link in its place.
    ValueError (as root) when what is there now is not root's own directory, or lies under a
    directory :func:`_check_parents` refuses."""
    # a parent missing at the check may be another user's (or a link) now: make nothing in it
    _check_parents(path, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()  # a link is not followed: it is refused
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{path}: not a directory")
    _check_owner(st, path)
    _check_parents(path, path)  # and again: it may have appeared meanwhile
