"""Armed for planned stops, a child started by ``os.posix_spawn`` starts with SIGTERM unblocked,
as one started by fork or ``_posixsubprocess`` does (docs/run.md, the rank's own children):
``subprocess`` takes that way with ``close_fds=False`` and an executable path, and such a child
ignored SIGTERM, ending only by SIGKILL.

A real armed process (as tests/test_audit_children.py) and real children; each child reads its
own blocked-signal mask from /proc."""

from __future__ import annotations

import signal
import subprocess
import sys

# SigBlk of the rank itself, then of each child: subprocess by posix_spawn, os.posix_spawn(p)
SCRIPT = """
from worker_server.stop_signal import watch_sigterm
print("unarmed:", watch_sigterm(), flush=True)
import os, subprocess, sys
grep = ["/bin/grep", "SigBlk", "/proc/self/status"]
print("rank", open("/proc/self/status").read().split("SigBlk:")[1].split()[0], flush=True)
for how in ("subprocess", "posix_spawn", "posix_spawnp"):
    print(how, end=" ", flush=True)
    if how == "subprocess":
        subprocess.run(grep, close_fds=False, check=True)
    else:
        pid = getattr(os, how)(grep[0] if how == "posix_spawn" else "grep", grep, os.environ)
        os.waitpid(pid, 0)
"""


def test_children_started_by_posix_spawn_get_sigterm_unblocked():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "unarmed: None", res.stdout
    masks = {line.split()[0]: int(line.split()[-1], 16) for line in lines[1:]}
    bit = 1 << (signal.SIGTERM - 1)
    assert masks["rank"] & bit, res.stdout  # armed: the rank's main thread blocks it
    assert {how: mask & bit for how, mask in masks.items() if how != "rank"} == \
        {"subprocess": 0, "posix_spawn": 0, "posix_spawnp": 0}, res.stdout
