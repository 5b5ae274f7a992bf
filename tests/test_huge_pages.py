"""pymalloc's arenas on transparent huge pages (monitor/huge_pages.py, monitor/_hugearenas.c).

The allocator is process-wide and cannot be taken back, so it is exercised in a fresh Python
process of its own (never in pytest's): objects made before it is installed and after, freed
and made again, must read back whole; arenas must come from its chunks, empty chunks go back to
the system, and arenas it did not make go back to pymalloc's own allocator. That the kernel
really backs the chunks with huge pages is checked where it offers transparent huge pages
(``/sys/kernel/mm/transparent_hugepage/enabled``); elsewhere that one assertion is skipped and
says so. The monitor's wiring (from ``MIN_TARGETS`` targets, once, never with ``off``) is
tested with ``enable`` replaced by a recorder: the real one would change pytest's allocator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from monitor import huge_pages
from monitor.config import ConfigError, MonitorConfig
from monitor.service import Monitor

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
from monitor import huge_pages

def anon_huge_kib():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0

before = [[i, str(i)] for i in range(300_000)]          # arenas of pymalloc's own
why = huge_pages.enable()
assert why is None, why
assert huge_pages.enable() is None                        # a second call: nothing new
after = [[i, str(i)] for i in range(2_000_000)]         # ~200 MB of small objects
held = huge_pages.stats()
huge_kib = anon_huge_kib()
assert all(x[0] == i and x[1] == str(i) for i, x in enumerate(after))
del before                                                # freed into pymalloc's own allocator
del after                                                 # chunks emptied: back to the system
freed = huge_pages.stats()
again = [[i, str(i)] for i in range(500_000)]           # made again in chunks
assert all(x[0] == i and x[1] == str(i) for i, x in enumerate(again))
print(json.dumps({"held": held, "freed": freed, "again": huge_pages.stats(),
                  "huge_kib": huge_kib}))
"""


def run_child() -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_arenas_live_in_huge_page_chunks_and_objects_read_back_whole():
    if os.environ.get("CI") == "true":  # bin/bootstrap builds it where a C compiler is
        assert huge_pages._hugearenas is not None, "monitor/_hugearenas.c was not built"
    why = huge_pages.unavailable()
    if why is not None:
        pytest.skip(why)
    got = run_child()
    held, freed, again = got["held"], got["freed"], got["again"]
    chunk_arenas = held["chunk_bytes"] // (1 << 20)
    # ~200 MB of objects in 1 MiB arenas, served from 32 MiB chunks
    assert held["arenas"] >= 150 and held["chunks"] >= held["arenas"] // chunk_arenas, held
    # everything freed: the emptied chunks were unmapped (one kept as the spare), and the
    # arenas made before install() went back to pymalloc's own allocator
    assert freed["chunks_unmapped"] >= held["chunks"] - 2, freed
    assert freed["chunks"] <= 2 and freed["foreign_frees"] >= 10, freed
    assert again["arenas"] >= 30, again
    if huge_pages.thp_mode() in ("always", "madvise"):
        # the kernel backed the chunks with huge pages (~200 MB of them, at least half)
        assert got["huge_kib"] >= 100 * 1024, got


def test_thp_mode_reads_the_kernels_choice(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert huge_pages.thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert huge_pages.thp_mode(str(f)) == "always"
    f.write_text("garbage\n")
    assert huge_pages.thp_mode(str(f)) is None
    assert huge_pages.thp_mode(str(tmp_path / "absent")) is None


def test_unavailable_says_why(monkeypatch):
    monkeypatch.setattr(huge_pages, "_hugearenas", None)
    assert "not built" in huge_pages.unavailable()
    assert "not built" in huge_pages.enable()  # and changes nothing
    assert huge_pages.stats() is None
    monkeypatch.setattr(huge_pages, "_hugearenas", object())
    monkeypatch.setattr(huge_pages, "thp_mode", lambda path=huge_pages.THP_PATH: "never")
    if sys.platform.startswith("linux"):
        assert "never" in huge_pages.unavailable()


def test_config_refuses_an_unknown_mode():
    with pytest.raises(ConfigError, match="huge_pages"):
        MonitorConfig(huge_pages="auto").validate()


@pytest.mark.parametrize("mode", ["on", "off"])
def test_monitor_enables_them_once_from_min_targets_never_when_off(tmp_path, monkeypatch, mode):
    calls = []
    monkeypatch.setattr(huge_pages, "enable", lambda: calls.append(1) or None)
    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "m.db"), huge_pages=mode))
    try:
        mon._fit_poller(huge_pages.MIN_TARGETS - 1)
        assert calls == [] and mon.huge_pages is None
        assert mon.cluster_json()["huge_pages"] is None  # not decided below the threshold
        mon._fit_poller(huge_pages.MIN_TARGETS)
        mon._fit_poller(huge_pages.MIN_TARGETS * 2)
        shown = mon.cluster_json()["huge_pages"]
        if mode == "on":
            assert calls == [1] and shown == {"on": True, "why_not": None}
        else:
            assert calls == [] and shown == {"on": False,
                                             "why_not": "off (--huge-pages off, the default)"}
    finally:
        mon.stop()


def test_monitor_says_why_not_and_sweeps_on(tmp_path, monkeypatch):
    monkeypatch.setattr(huge_pages, "enable", lambda: "the kernel offers none")
    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "m.db"), huge_pages="on"))
    try:
        mon._fit_poller(huge_pages.MIN_TARGETS)
        assert mon.cluster_json()["huge_pages"] == {"on": False,
                                                    "why_not": "the kernel offers none"}
    finally:
        mon.stop()
