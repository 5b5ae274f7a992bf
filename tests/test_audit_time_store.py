"""What the monitor keeps and shows when its clock was set back between two runs (NTP correcting
a clock that ran ahead), and the timezone of the times it shows (docs/monitor.md, Limits).

A restart is two ``BundleStore`` / ``Monitor`` lives on one ``--state`` with injected clocks:
the second one's behind the first one's, as a restart on a host whose clock was corrected is.
"""

from __future__ import annotations

import calendar
import os
import re
import sys
import time

import requests

from lightkeeper.processes import start_monitor_process, stop_process, wait_until
from monitor.act.bundles import BundleStore
from monitor.config import BundleConfig, MonitorConfig
from monitor.service import Monitor
from monitor.store import Store

T0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC


def test_bundles_after_a_restart_with_the_clock_set_back_keep_the_newest(tmp_path):
    """Listed newest first and pruned oldest first by when they were written, not by ``at``:
    before, the bundle just written (the one its decision names) was listed last and deleted
    by the total cap, the older run's one kept."""
    cfg = BundleConfig(keep_s=14 * 86400, total_bytes=3000, max_bytes=3000)
    folder = str(tmp_path / "incidents")

    def write(bs: BundleStore, at: float, group: int) -> str:
        bid = bs.new_id("evict", "hang", group)
        assert bs.write(bid, {"format": "x"}, [("blob", os.urandom(1000))],
                        {"at": at, "trigger": "evict", "summary": {}}) is not None
        return bid

    store = Store(str(tmp_path / "s.sqlite"))
    try:
        a = write(BundleStore(cfg, folder, store, clock=lambda: T0), T0, 0)
        later = BundleStore(cfg, folder, store, clock=lambda: T0 - 600)  # restarted, set back
        b = write(later, T0 - 600, 1)
        assert [r["id"] for r in later.list()] == [b, a]
        c = write(later, T0 - 590, 2)  # three exceed the cap: the oldest written goes
        assert [r["id"] for r in later.list()] == [c, b]
        assert sorted(os.listdir(folder)) == sorted([f"{b}.tar.gz", f"{c}.tar.gz"])
    finally:
        store.close()


def test_the_overview_says_its_times_are_utc(tmp_path):
    """Before, the overview showed ``HH:MM:SS`` in the monitor's local timezone, unlabelled."""
    store = Store(str(tmp_path / "state.sqlite"))
    store.add_decision(replica_group=1, replica_id="replica_group_1:x", decision="hold",
                       reason="test", detail="", at=T0)
    store.close()
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        job="t")
    mon = Monitor(cfg, clock=lambda: T0 + 60).start()
    try:
        page = requests.get(mon.url + "/", timeout=10).text
    finally:
        mon.stop()
    row = re.search(r'<tr class="hold"><td>([^<]*)</td>', page)
    assert row and row.group(1) == "2027-01-15 08:00:00 UTC", row and row.group(1)


def test_the_monitors_log_lines_are_stamped_in_utc(tmp_path):
    """On a host whose local time is UTC+5:30, the log's times are UTC and end in ``Z``. Before,
    ``2026-11-27 17:41:02,113``: the host's local time, its zone unsaid."""
    env = {**os.environ, "TZ": "Asia/Kolkata"}
    log = tmp_path / "monitor.log"
    proc, _ = start_monitor_process(
        [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0", "--interval", "0.2",
         "--state", str(tmp_path / "state.sqlite"), "--lighthouse", "http://127.0.0.1:1"],
        tmp_path / "monitor.out", log, env=env)  # an unreachable Lighthouse: a warning
    try:
        line = wait_until(lambda: log.read_text().splitlines()[0] if log.read_text() else None,
                          30, what="a log line")
    finally:
        stop_process(proc, grace=3)
    stamp = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.\d{3}Z ", line)
    assert stamp, line
    at = calendar.timegm(time.strptime(stamp.group(1), "%Y-%m-%dT%H:%M:%S"))
    assert abs(at - time.time()) < 120, line
