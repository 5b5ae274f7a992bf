"""One replica group's wall clock off by a fixed offset: Debian's libfaketime, for tests and
benchmarks that check the monitor never compares hosts' clocks.

:func:`faketime_env` returns the environment that runs a process with its wall clock ``offset_s``
ahead (``LD_PRELOAD`` and ``FAKETIME`` as Debian's ``faketime`` wrapper sets them) and a true
monotonic clock, as on a host whose NTP is off (``FAKETIME_DONT_FAKE_MONOTONIC=1``), or None
when ``faketime`` is not installed (``bin/bootstrap --system`` installs it).

libfaketime 0.9.10 with a true monotonic clock answers Python's ``time.sleep`` (a
``clock_nanosleep`` to an absolute monotonic deadline) with EINVAL, and faking the monotonic clock
as well makes every timed lock wait forever. So the shifted processes also get a
``sitecustomize`` (on ``PYTHONPATH``) whose ``time.sleep`` falls back to a relative wait when the
real one fails. Nothing else is changed.
"""

from __future__ import annotations

import shutil
import subprocess
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


def faketime_env(offset_s: float, shim_dir: str | Path) -> dict[str, str] | None:
    """Environment for a process whose wall clock runs ``offset_s`` seconds ahead (negative:
    behind); None without Debian's ``faketime``."""
    if not shutil.which("faketime"):
        return None
    out = subprocess.run(["faketime", "-f", f"{offset_s:+g}s", "env"], capture_output=True,
                         text=True, timeout=10, check=True).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    shim = Path(shim_dir)
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(SLEEP_SHIM)
    return {"LD_PRELOAD": env["LD_PRELOAD"], "FAKETIME": env["FAKETIME"],
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "PYTHONPATH": str(shim)}
