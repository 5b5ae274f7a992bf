"""``lightkeeper demo --keep-running``: after the scenario everything stays up until SIGTERM.

Two healthy demos (no Prometheus), started at once: the scenario ends by its
``--duration`` in one and once every group trained its ``--steps`` in the other. Each test polls
until the report is written and the cluster is announced, checks that every process still
serves (and keeps working: steps and sweeps advance), sends SIGTERM and checks that every
process the demo started is gone within a deadline. The same checks on a 3 x 2 torchrun job with
faults, Prometheus and FT-HSDP's Flight Recorder evidence: tests/test_demo_e2e.py's default
scenario, which runs with ``--keep-running``.

The ``--steps`` run is also a ``--dry-run`` (a healthy job has nothing to evict, so it changes
nothing else here): it carries the demo's dry-run wiring (the monitor runs dry, hosts too, no
restart, no spare), which needs no demo of its own. That a real monitor holds a real finding
under --dry-run (tests/test_monitor_api.py) and that the demo's story ends at the hold
(tests/test_demo_faulttrack.py) are tested on their own parts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import requests

from tests.support.demo import RunningDemo, get_json

# solo: the demo's lock is machine-wide; 2 demos already fill the cores
pytestmark = [pytest.mark.e2e, pytest.mark.solo]

# The --duration run has one rank a group: what it checks is the demo's, not torchrun's (that is
# the default scenario's 3 x 2 job), and 3 processes importing torch start far sooner than 9.
# The --steps run keeps 2 (torchrun's ranks ending after their steps): one-rank groups trained
# their 8 steps before the last group committed its first, leaving no healthy phase.
COMMON = ["--no-faults", "--no-prometheus"]
MODES = {
    # the scenario ends by its --duration
    "duration": ["--duration", "3", "--ranks-per-group", "1"],
    # ... or when every group trained its --steps
    "steps": ["--steps", "8", "--dry-run"],
}


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """Both demos, started at once; each test checks and stops its own. Much of a demo's
    start is waiting (the first quorum, then the scenario's 3 s or 8 steps), so the two
    overlap well. Each has a TMPDIR of its own, hence its own lock file (the lock keeps a
    user from starting a second demo by mistake; these two share nothing: ephemeral ports,
    their own report directories)."""
    started: dict[str, RunningDemo] = {}
    try:
        for name, mode in MODES.items():
            started[name] = RunningDemo.start(tmp_path_factory.mktemp(f"keep-running-{name}"),
                                              *COMMON, *mode)
        yield started
    finally:  # a demo whose test did not stop it (failed early, or deselected)
        for demo in started.values():
            demo.kill()


@pytest.mark.parametrize("name", list(MODES))
def test_keep_running_stays_up_until_sigterm(demos, name):
    mode, demo = MODES[name], demos[name]
    duration = "--duration" in mode
    report = None
    try:
        report = demo.announced(300)
        # a healthy run's report: no fault, no finding (with --steps the groups that trained
        # theirs said they finished: ended, not dead), no eviction, one healthy phase
        assert report["faults"] == [] and report["restarts"] == []
        assert report["detections"] == [], report["detections"]
        assert [e for e in report["evictions"] if e["decision"] == "evict"] == []
        assert [p["name"] for p in report["phases"]] == ["healthy"]
        # with --steps the groups may end within 1 s of all of them stepping (the first ones
        # to start train most of their steps alone): too short a look to give a pace
        rate = report["healthy_step_rate"]
        assert rate == report["phases"][0]["step_rate"]
        assert rate > 0 if duration else rate is None or rate > 0
        md = (demo.report_dir / "report.md").read_text()
        assert ("Healthy step rate: not measured" in md) == (rate is None)
        assert report["config"]["warm_spares"] is False
        # --dry-run reaches the monitor (it never evicts) and its host ledger (never
        # quarantines); nothing was restarted, so every group is where it first started
        dry_run = "--dry-run" in mode
        cluster = get_json(report["urls"]["monitor"] + "/v1/cluster")
        assert cluster["dry_run"] is dry_run and report["config"]["dry_run"] is dry_run
        assert report["hosts"]["dry_run"] is dry_run and report["hosts"]["quarantined"] == []
        assert not any(d["evicted"] for d in report["detections"]), report["detections"]
        assert [p["why"] for p in report["placements"]] == ["first start"] * 3
        # everything still serves, and keeps working (with --duration the ranks keep
        # training; with --steps they finished and exited, the rest stays up)
        ranks = demo.check_keeps_working(report, stepping=duration)
        if duration and report["hosts"]["hosts"][0]["addr"].startswith("198.18."):
            # namespaced hosts (root, as in CI): reached through the demo's 127.0.0.1 forwards
            assert len(set(ranks)) == 3, demo.text()
            assert all(u.startswith("http://127.0.0.1:") for u in ranks), ranks
        elif duration:  # each group's rank on its host's own loopback address (docs/demo.md)
            assert len(ranks) == 3, demo.text()
            assert sorted({u.rsplit(":", 1)[0] for u in ranks}) == [
                "http://127.0.0.2", "http://127.0.0.3", "http://127.0.0.4"], ranks
        else:
            assert [e["detail"] for e in report["events"] if e["kind"] == "stop"] == [
                "every group trained 8 steps"], report["events"]
            # the ranks said they finished before they went: not unreachable, they ended
            metrics = requests.get(report["urls"]["monitor"] + "/metrics", timeout=5).text
            unreachable = re.search(r"^lightkeeper_monitor_ranks_unreachable\{.*\} (\S+)$",
                                    metrics, re.M)
            assert unreachable and float(unreachable[1]) == 0, metrics
        if duration:  # its ranks see no GPU, whatever this machine has (docs/demo.md)
            for url in ranks:
                pid = get_json(url + "/v1/state")["pid"]
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert b"CUDA_VISIBLE_DEVICES=" in environ, (url, pid)
    except BaseException:
        demo.kill()
        raise
    final = demo.stop(report)
    # healthy to the end (the --steps ranks gone for 5+ sweeps by then), its checks included
    assert final["detections"] == [] and final["faults"] == [], final["detections"]
    if duration:
        assert [p["name"] for p in final["phases"]] == ["healthy"], final["phases"]
