"""File locks: one process per state file (``--state``) and per ``--sd-out`` file. A lock
holds its owner's PID so a refusal can name who holds it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat


class StateInUse(RuntimeError):
    """Another monitor holds the state file."""


class LockHeld(RuntimeError):
    """Another process holds a :func:`pid_lock`; ``holder`` is the PID it wrote there."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def pid_lock(lock_path: str, posix: bool = False) -> int:
    """Hold an exclusive lock on ``lock_path`` and write this process's PID in it; the lock's
    descriptor (closing it lets go). ``posix``: a record lock, which this process may take
    again (a flock is refused to a second open in this process too). Raises LockHeld naming
    the holder, OSError when the file cannot be opened."""
    lock, busy = (fcntl.lockf, OSError) if posix else (fcntl.flock, BlockingIOError)
    # never through a link, never another user's file: a lock in a shared folder (/tmp) is
    # truncated and written, and its PID offered to be killed
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise OSError(errno.EPERM, "not a regular file of this user: not used as a lock",
                      lock_path)
    try:
        lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except busy:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise LockHeld(holder) from None
    with contextlib.suppress(OSError):  # a full disk: held all the same, the PID unsaid
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
    return fd


def file_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path``, None when it is gone: a lock or a file deleted and made
    again under a running monitor is another file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def hold_state(path: str) -> int | None:
    """Hold ``path`` for this process: a :func:`pid_lock` on ``<path>.lock`` (two monitors on
    one audit log would close each other's findings); the lock's descriptor, to close at the
    end. Raises StateInUse naming the holder, OSError when it cannot be made."""
    if path == ":memory:":
        return None
    if os.path.isdir(path):  # SQLite would say only "unable to open database file"
        raise IsADirectoryError(errno.EISDIR, "a folder, not a file", path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:  # the file's own name: a symlink to it must find the same lock
        return pid_lock(f"{os.path.realpath(path)}.lock")
    except LockHeld as e:
        raise StateInUse(f"{path} is in use by another monitor (PID {e.holder})") from None
