"""Reading a child process's first line of output, with a deadline."""

from __future__ import annotations

import select
import subprocess
import time


def first_line(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """The first line ``proc`` writes to its stdout (a pipe); AssertionError if none comes
    within ``timeout`` s or it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            return proc.stdout.readline().decode().strip()
        if proc.poll() is not None:
            break
    raise AssertionError(f"no line from {proc.args[-4:]} (exit {proc.poll()})")
