"""Bad quarantine flag values given to the real ``lightkeeper monitor`` CLI: each stops it at
start-up with exit status 2 and one line naming the flag (docs/quarantine.md, Flags), never a
traceback and never a monitor that runs with a window, TTL or cap that means nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("flag,value", [
    ("--quarantine-window", "nan"), ("--quarantine-ttl", "nan"), ("--quarantine-ttl", "inf"),
    ("--max-quarantined", "nan"), ("--max-quarantined", "inf"), ("--action-timeout", "nan"),
    ("--action-timeout", "inf"), ("--max-quarantined", "2.5"), ("--quarantine-window", "0")])
def test_a_bad_quarantine_flag_value_exits_2_naming_it(tmp_path, flag, value):
    p = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
                        "--state", str(tmp_path / "m.sqlite"), flag, value],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr and flag in p.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "m.sqlite").exists()
