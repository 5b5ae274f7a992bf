"""``lightkeeper demo --keep-running``: after the scenario everything stays up until SIGTERM.

A healthy demo (no Prometheus) whose scenario ends once every group trained its ``--steps``:
the test polls until the report is written and the cluster is announced, checks that every
process still serves (the monitor keeps sweeping), sends SIGTERM and checks that every process
the demo started is gone within a deadline. The same checks on a 3 x 2 torchrun job with
faults, Prometheus and FT-HSDP's Flight Recorder evidence, whose ranks keep stepping: the
default scenario of tests/test_demo_e2e.py, which runs with ``--keep-running`` and also checks
where each rank listens and that it sees no GPU. The end by ``--duration`` is a unit test
(tests/test_demo_hosts.py); a job of one rank a group, tests/test_demo_e2e.py's fault run.

The run is also a ``--dry-run`` (a healthy job has nothing to evict, so it changes nothing
else here): it carries the demo's dry-run wiring (the monitor runs dry, hosts too, no restart,
no spare), which needs no demo of its own. That a real monitor holds a real finding under
--dry-run (tests/test_monitor_api.py) and that the demo's story ends at the hold
(tests/test_demo_faulttrack.py) are tested on their own parts.
"""

from __future__ import annotations

import re

import pytest
import requests

from tests.support.demo import RunningDemo, get_json

# solo: its six ranks fill both cores; a second demo beside it would fail on the demo's lock
pytestmark = [pytest.mark.e2e, pytest.mark.solo]


def test_keep_running_stays_up_until_sigterm(tmp_path):
    # torchrun's 2 ranks a group: one-rank groups trained their 8 steps before the last
    # group committed its first, leaving no healthy phase
    demo = RunningDemo.start(tmp_path, "--no-faults", "--no-prometheus", "--steps", "8",
                             "--dry-run")
    report = None
    try:
        report = demo.announced(300)
        # a healthy run's report: no fault, no finding (the groups that trained their steps
        # said they finished: ended, not dead), no eviction, one healthy phase
        assert report["faults"] == [] and report["restarts"] == []
        assert report["detections"] == [], report["detections"]
        assert [e for e in report["evictions"] if e["decision"] == "evict"] == []
        assert [p["name"] for p in report["phases"]] == ["healthy"]
        # the groups may end within 1 s of all of them stepping (the first ones to start
        # train most of their steps alone): too short a look to give a pace
        rate = report["healthy_step_rate"]
        assert rate == report["phases"][0]["step_rate"] and (rate is None or rate > 0)
        md = (demo.report_dir / "report.md").read_text()
        assert ("Healthy step rate: not measured" in md) == (rate is None)
        assert report["config"]["warm_spares"] is False
        # --dry-run reaches the monitor (it never evicts) and its host ledger (never
        # quarantines); nothing was restarted, so every group is where it first started
        cluster = get_json(report["urls"]["monitor"] + "/v1/cluster")
        assert cluster["dry_run"] is True and report["config"]["dry_run"] is True
        assert report["hosts"]["dry_run"] is True and report["hosts"]["quarantined"] == []
        assert [p["why"] for p in report["placements"]] == ["first start"] * 3
        # the ranks finished and exited; everything else still serves and keeps working
        demo.check_keeps_working(report, stepping=False)
        assert [e["detail"] for e in report["events"] if e["kind"] == "stop"] == [
            "every group trained 8 steps"], report["events"]
        # the ranks said they finished before they went: not unreachable, they ended
        metrics = requests.get(report["urls"]["monitor"] + "/metrics", timeout=5).text
        unreachable = re.search(r"^lightkeeper_monitor_ranks_unreachable\{.*\} (\S+)$",
                                metrics, re.M)
        assert unreachable and float(unreachable[1]) == 0, metrics
    except BaseException:
        demo.kill()
        raise
    final = demo.stop(report)
    # healthy to the end (the ranks gone for 5+ sweeps by then), its checks included
    assert final["detections"] == [] and final["faults"] == [], final["detections"]
