"""examples/torchft_two_groups.py's Lighthouse, started as its docstring says: torchft takes the
flags, and its heartbeat timeout is one the monitor does not call slow, so a run that ends
cleanly (a group leaving) logs no "slow Lighthouse settings" warning (docs/lighthouse.md)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import requests

from lightkeeper.processes import free_port, stop_process, wait_until
from monitor.evidence.lighthouse_settings import SLOW_S

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchft_two_groups.py"


def documented_lighthouse() -> list[str]:
    [line] = [x.strip() for x in EXAMPLE.read_text().splitlines()
              if x.strip().startswith("torchft_lighthouse ")]
    return shlex.split(line)


def test_the_examples_lighthouse_settings_are_not_slow():
    argv = documented_lighthouse()
    flags = dict(zip(argv[1::2], argv[2::2], strict=True))
    heartbeat_ms = int(flags.get("--heartbeat_timeout_ms", 5000))  # torchft's default
    assert heartbeat_ms / 1000 <= SLOW_S, argv
    port = free_port()
    flags["--bind"] = re.sub(r":\d+$", f":{port}", flags["--bind"])
    lighthouse = str(Path(sys.executable).parent / "torchft_lighthouse")
    proc = subprocess.Popen([lighthouse, *(x for kv in flags.items() for x in kv)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def up():
            assert proc.poll() is None, proc.stderr.read().decode()  # a flag it refused
            try:
                return requests.get(f"http://127.0.0.1:{port}/status", timeout=2).ok
            except requests.ConnectionError:
                return False
        wait_until(up, 30, what="the example's Lighthouse to answer /status")
    finally:
        stop_process(proc, grace=2)
