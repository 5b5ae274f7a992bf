"""tests/support/faketime.py: a faked process that is killed leaves nothing in ``/dev/shm``.

libfaketime names its semaphore and shared page after the PID of the process that made them and
creates them exclusively: one left behind by a killed process made a later faked process (or
the ``faketime`` wrapper) that got the same PID exit 1, which failed CI once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import require_binary
from tests.support.faketime import faketime_env

PRINT_AND_WAIT = "import os, sys, time; print(os.getpid(), time.time(), flush=True); sys.stdin.read()"


def pid_named(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.endswith(f"_{pid}")]


def test_a_killed_faked_process_leaves_no_shared_objects_and_sees_the_offset(tmp_path: Path):
    require_binary("faketime")
    env = faketime_env(-3600.5, tmp_path / "shim")
    proc = subprocess.Popen([sys.executable, "-c", PRINT_AND_WAIT], env={**os.environ, **env},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid, faked = proc.stdout.readline().split()
        assert -3605 < float(faked) - time.time() < -3595
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert pid_named(int(pid)) == []
    shared = env["FAKETIME_SHARED"].split()
    assert Path("/dev/shm" + shared[1]).exists()  # ours, removed when this test process exits
