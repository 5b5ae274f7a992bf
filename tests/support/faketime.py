"""One replica group's wall clock off by a fixed offset: Debian's libfaketime, for tests and
benchmarks that check the monitor never compares hosts' clocks.

:func:`faketime_env` returns the environment that runs a process with its wall clock ``offset_s``
ahead (``LD_PRELOAD`` and ``FAKETIME``, as Debian's ``faketime`` wrapper sets them) and a true
monotonic clock, as on a host whose NTP is off (``FAKETIME_DONT_FAKE_MONOTONIC=1``), or None
when libfaketime is not installed (``bin/bootstrap --system`` installs it). :func:`stepping_env`
is the same with the offset read from a file on every call, for a clock that steps.

libfaketime keeps a semaphore and a shared-memory page named after the PID of whichever process
made them (the ``faketime`` wrapper, or a preloaded process started without one) and creates them
with ``O_EXCL``: a faked process that is killed leaves its pair in ``/dev/shm``, and a later one
that gets the same PID exits 1 ("shm_open: File exists"). So this module makes each
environment's pair itself, under a unique name, hands it over in ``FAKETIME_SHARED`` (the
preloaded processes then only open it) and removes it when the test process exits.

libfaketime 0.9.10 with a true monotonic clock answers Python's ``time.sleep`` (a
``clock_nanosleep`` to an absolute monotonic deadline) with EINVAL, and faking the monotonic clock
as well makes every timed lock wait forever. So the shifted processes also get a
``sitecustomize`` (on ``PYTHONPATH``) whose ``time.sleep`` falls back to a relative wait when the
real one fails. Nothing else is changed.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import os
import secrets
import struct
from pathlib import Path

SLEEP_SHIM = '''"""Written by tests/support/faketime.py: time.sleep that survives libfaketime."""
import select
import time

_sleep = time.sleep


def _sleep_relative(seconds):
    try:
        _sleep(seconds)
    except OSError:
        select.select([], [], [], seconds)


time.sleep = _sleep_relative
'''

# where Debian's and upstream's ``make install`` put the library the wrapper preloads
LIBRARY_GLOBS = ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1",
                 "/usr/local/lib/faketime/libfaketime.so.1")
# libfaketime's ``struct ft_shared_s`` as its wrapper starts it: no ticks, no file index, and the
# start time (real, monotonic, raw, boot timespecs) unset (tv_nsec -1): the first faked process
# sets it; with zeros every faked process would start its clocks at 0. Padded to a page.
SHARED_START = struct.pack("<QQ" + "qq" * 4, 0, 0, *(0, -1) * 4).ljust(4096, b"\0")


def library() -> str | None:
    """The path of ``libfaketime.so.1``, or None when it is not installed."""
    return next((p for pattern in LIBRARY_GLOBS for p in sorted(glob.glob(pattern))), None)


def _shared_objects() -> str:
    """A new semaphore and shared page for libfaketime, removed at exit: ``FAKETIME_SHARED``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sem_open.restype = ctypes.c_void_p
    libc.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
    name = f"lightkeeper_faketime_{os.getpid()}_{secrets.token_hex(6)}"
    sem_name, shm_path = f"/{name}_sem".encode(), f"/dev/shm/{name}_shm"
    sem = libc.sem_open(sem_name, os.O_CREAT | os.O_EXCL, 0o600, 1)  # the wrapper's: a mutex
    if not sem:
        raise OSError(ctypes.get_errno(), f"sem_open {sem_name.decode()}")
    libc.sem_close(ctypes.c_void_p(sem))
    fd = os.open(shm_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, SHARED_START)
    finally:
        os.close(fd)

    def remove() -> None:
        libc.sem_unlink(sem_name)
        Path(shm_path).unlink(missing_ok=True)

    atexit.register(remove)
    return f"/{name}_sem /{name}_shm"


def faketime_env(offset_s: float, shim_dir: str | Path) -> dict[str, str] | None:
    """Environment for a process whose wall clock runs ``offset_s`` seconds ahead (negative:
    behind); None without libfaketime."""
    lib = library()
    if lib is None:
        return None
    shim = Path(shim_dir)
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(SLEEP_SHIM)
    return {"LD_PRELOAD": lib, "FAKETIME": f"{offset_s:+f}s", "FAKETIME_SHARED": _shared_objects(),
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "PYTHONPATH": str(shim)}


def stepping_env(shim_dir: str | Path, offset_file: str | Path) -> dict[str, str] | None:
    """Environment for a process whose wall clock is off by what ``offset_file`` says (``+0s`` at
    first; write ``+3600s`` to step it an hour forward), read on every call; None without
    libfaketime."""
    env = faketime_env(0, shim_dir)
    if env is None:
        return None
    Path(offset_file).write_text("+0s\n")
    env.pop("FAKETIME")
    env.update(FAKETIME_TIMESTAMP_FILE=str(offset_file), FAKETIME_NO_CACHE="1")
    return env
