"""tests/support/faketime.py: libfaketime's leftovers of killed processes are removed.

libfaketime names a faked process's semaphore and shared page after its PID and creates them
exclusively: a pair left behind by a killed process made a later faked process (or the
``faketime`` wrapper) that got the same PID exit 1, which failed CI once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import require_binary
from tests.support.faketime import faketime_env


def test_pairs_of_dead_processes_are_removed_and_a_faked_process_runs(tmp_path: Path):
    require_binary("faketime")
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, alive = gone.pid, os.getpid()
    made = [Path(f"/dev/shm/{name}") for pid in (dead, alive)
            for name in (f"faketime_shm_{pid}", f"sem.faketime_sem_{pid}")]
    for p in made:
        p.write_bytes(b"")
    try:
        env = faketime_env(-3600.5, tmp_path / "shim")
        assert [p.exists() for p in made] == [False, False, True, True]
        out = subprocess.run([sys.executable, "-c", "import time; print(time.time())"],
                             env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=30, check=True).stdout
        assert -3605 < float(out) - time.time() < -3595
    finally:
        for p in made:
            p.unlink(missing_ok=True)
