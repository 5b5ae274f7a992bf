"""One replica group's wall clock off by a fixed offset: Debian's libfaketime, for tests and
benchmarks that check the monitor never compares hosts' clocks.

:func:`faketime_env` returns the environment that runs a process with its wall clock ``offset_s``
ahead (``LD_PRELOAD`` and ``FAKETIME``, as Debian's ``faketime`` wrapper sets them) and a true
monotonic clock, as on a host whose NTP is off (``FAKETIME_DONT_FAKE_MONOTONIC=1``), or None
when libfaketime is not installed (``bin/bootstrap --system`` installs it). :func:`stepping_env`
is the same with the offset read from a file on every call, for a clock that steps.

libfaketime gives every faked process a semaphore and a shared page in ``/dev/shm`` named after
its PID (its children share them), made with ``O_EXCL`` and removed at a normal exit: a faked
process that is killed leaves its pair behind, and a later faked process (or the ``faketime``
wrapper) that gets the same PID exits 1 ("shm_open: File exists"). So :func:`faketime_env`
first removes the pairs of PIDs that no longer run. (One pair for every process of an
environment would do too, but a process killed while it holds the semaphore, e.g. in a
``stat``, would then stop all the others.)

libfaketime 0.9.10 with a true monotonic clock answers Python's ``time.sleep`` (a
``clock_nanosleep`` to an absolute monotonic deadline) with EINVAL, and faking the monotonic clock
as well makes every timed lock wait forever. So the shifted processes also get a
``sitecustomize`` (on ``PYTHONPATH``) whose ``time.sleep`` falls back to a relative wait when the
real one fails. Nothing else is changed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
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
STALE = re.compile(r"(?:sem\.)?faketime_(?:sem|shm)_(\d+)")


def library() -> str | None:
    """The path of ``libfaketime.so.1``, or None when it is not installed."""
    return next((p for pattern in LIBRARY_GLOBS for p in sorted(glob.glob(pattern))), None)


def remove_stale_objects(shm: str = "/dev/shm") -> None:
    """Remove libfaketime's semaphores and pages whose process no longer runs."""
    with contextlib.suppress(OSError):
        for name in os.listdir(shm):
            m = STALE.fullmatch(name)
            if m and not os.path.exists(f"/proc/{m[1]}"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(shm, name))


def faketime_env(offset_s: float, shim_dir: str | Path) -> dict[str, str] | None:
    """Environment for a process whose wall clock runs ``offset_s`` seconds ahead (negative:
    behind); None without libfaketime."""
    lib = library()
    if lib is None:
        return None
    shim = Path(shim_dir)
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(SLEEP_SHIM)
    remove_stale_objects()
    return {"LD_PRELOAD": lib, "FAKETIME": f"{offset_s:+f}s", "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "PYTHONPATH": str(shim)}


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
