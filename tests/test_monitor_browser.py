"""The HTML overview in headless Chromium against a live monitor: groups render, a finding shows.

Simulated ranks stand in for the trainer (the page is the same); a rank taken down becomes a
``dead_rank`` finding (its group's rank 0 still answers), which the page must show after a
reload, with the culprit's host. Chromium is driven as a plain subprocess (``--headless
--dump-dom``): the DOM after the page loaded.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from lightkeeper.processes import wait_until
from monitor.config import DetectorConfig, MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.conftest import require_binary
from tests.support.monitor_sim import SimRanks

pytestmark = pytest.mark.e2e


def dump_dom(chromium: str, url: str, tmp_path) -> str:
    out = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--disable-extensions", f"--user-data-dir={tmp_path / 'chromium'}",
         "--dump-dom", url],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_overview_renders_groups_and_a_finding(tmp_path):
    chromium = require_binary("chromium")
    sim = SimRanks.start(6, groups=3)
    mon = Monitor(MonitorConfig(port=0, interval_s=0.3, state_path=str(tmp_path / "s.sqlite"),
                                targets=sim.urls, job="sim",
                                detectors=DetectorConfig(dead_sweeps=2),
                                rails=RailsConfig(dry_run=True))).start()
    try:
        wait_until(lambda: mon.sweeps >= 2, 10, what="sweeps")
        dom = dump_dom(chromium, mon.url + "/", tmp_path)
        groups = re.findall(r'<tr class="group\s*" data-replica-group="(\d+)"', dom)
        assert groups == ["0", "1", "2"], dom[:3000]
        assert len(re.findall(r'<tr class="rank" data-rank="\d+"', dom)) == 6
        assert sim.urls[0] + "/v1/stacks" in dom and sim.urls[0] + "/v1/fr_trace" in dom
        assert "no findings" in dom and "DRY RUN" in dom

        sim.ranks[4].set_mode("down")  # rank 4 is group rank 1 of replica group 1
        wait_until(lambda: mon.detectors.open_findings(), 10, what="the dead finding")
        dom = dump_dom(chromium, mon.url + "/", tmp_path)
        row = re.search(r'<tr class="group finding" data-replica-group="1">(.*?)</tr>', dom, re.S)
        assert row, dom[:4000]
        assert re.search(r'class="open-findings">\s*dead_rank\s*<', dom)
        assert re.search(r'<tr class="finding-row finding" data-kind="dead_rank">', dom)
        assert re.search(r'<td class="hosts">\s*sim\s*</td>', dom)  # where the culprit runs
    finally:
        mon.stop()
        sim.stop()
