"""Audit of the monitor's noticed defects: an evicted group's exit is no ``dead`` finding, and
more (each test says which)."""

from __future__ import annotations

from monitor.api.views import goodput_json
from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.support.monitor_sim import SimJob
from tests.test_monitor_detectors import T0, Job


def test_an_evicted_incarnation_going_is_no_dead_finding_a_crash_beside_it_is():
    """After an eviction the kill's own effect (the group's Manager gone, then its peers)
    opened a ``dead`` finding: noise. A crash beside it is still found, and a dead finding
    evicted (--evict-on dead) is resolved ``evicted``."""
    job = Job()
    det = Detectors(DetectorConfig(dead_sweeps=2))
    job.steps(5, now=T0)
    evicted = {job.states[2]["replica_id"]}  # group 1 killed through the Lighthouse

    def sweep(now):
        view = job.view(now)
        return det.update(view.evidence(), None, now, full_view=view, evicted=evicted)

    sweep(T0)
    job.down = {2}  # the kill ends group 1's Manager (rank 0) first
    found = [f for t in (1, 2, 3) for f in sweep(T0 + t)]
    job.down = {2, 3, 4}  # then its rank 1 told to exit; group 2's Manager crashes on its own
    found += [f for t in (4, 5, 6) for f in sweep(T0 + t)]
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("dead", 2, [4])]
    evicted.add(job.states[4]["replica_id"])  # --evict-on dead: group 2 killed for it
    assert sweep(T0 + 7) == []
    assert [(f.kind, f.replica_group, f.resolution) for f in det.resolved_findings()] == [
        ("dead", 2, "evicted")]
    assert det.open_findings() == []


def test_a_monitor_that_never_swept_exports_what_monitor_missing_looks_for(tmp_path):
    """LightkeeperMonitorMissing asked for lightkeeper_monitor_sweeps_total, which a monitor
    exports only after its first good sweep: one up but never sweeping fired it beside
    LightkeeperMonitorNotSweeping. It now asks for lightkeeper_monitor_dry_run, exported from
    the start (promtool cases: dashboards/rule_model.py, NEVER_SWEPT)."""
    import requests

    from dashboards import rules
    from lightkeeper.processes import wait_until
    from monitor.config import MonitorConfig
    from monitor.service import Monitor

    mon = Monitor(MonitorConfig(port=0, interval_s=0.05, job="train",
                                state_path=str(tmp_path / "state.sqlite")))

    def broken(*a, **k):
        raise RuntimeError("every sweep fails")

    mon.polling.collect = broken
    mon.start()
    try:
        wait_until(lambda: requests.get(f"{mon.url}/healthz", timeout=5).json()["status"]
                   == "failing", 10, what="the first sweep failed")
        text = requests.get(f"{mon.url}/metrics", timeout=5).text
        assert 'lightkeeper_monitor_dry_run{job="train"} 0.0' in text
        assert "lightkeeper_monitor_sweeps_total{" not in text
        [missing] = [a for a in rules.ALERTS if a.name == "LightkeeperMonitorMissing"]
        assert "lightkeeper_monitor_dry_run" in missing.expr
    finally:
        mon.stop()


def test_groups_on_different_torchft_versions_are_said_once_and_in_cluster(tmp_path, caplog):
    """Every group of a job must run the same torchft (a 0.2.0 group fails every nightly rank's
    reconfigure): documented, never warned. The monitor now says it once in its log, naming
    the versions and groups, and /v1/cluster shows torchft_versions. Simulated ranks: the
    version is only what their /v1/state says."""
    import logging

    import requests

    from lightkeeper.processes import wait_until
    from monitor.config import MonitorConfig
    from monitor.service import Monitor
    from tests.support.monitor_sim import SimRanks

    sim = SimRanks.start(4, groups=3)
    mon = None
    try:
        for r in sim.ranks:
            r.update(torchft_version="2026.10.26" if r.state["replica_group"] == 2 else "0.2.0")
        caplog.set_level(logging.WARNING, logger="monitor.service")
        mon = Monitor(MonitorConfig(port=0, interval_s=0.05, job="sim", targets=sim.urls,
                                    state_path=str(tmp_path / "state.sqlite"))).start()

        def cluster():
            return requests.get(f"{mon.url}/v1/cluster", timeout=5).json()

        wait_until(lambda: cluster()["torchft_versions"], 10, what="the versions in /v1/cluster")
        assert cluster()["torchft_versions"] == {"0.2.0": [0, 1], "2026.10.26": [2]}
        for r in sim.ranks:  # a quorum change: every rank reshaped, the same versions
            r.update(quorum_id=2)
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 3, 10, what="sweeps after a quorum change")
        said = [r.getMessage() for r in caplog.records if "torchft versions" in r.getMessage()]
        assert said == ["replica groups of job sim run different torchft versions (0.2.0: "
                        "groups [0, 1]; 2026.10.26: groups [2]): every group must run the "
                        "same, or torchft-nightly's reconfigure fails at each quorum"], said
    finally:
        if mon is not None:
            mon.stop()
        sim.stop()


def test_survivors_held_by_a_group_just_evicted_are_no_job_stall(tmp_path):
    """The dead finding the kill used to open also stood for the evicted group in the job-wide
    detector (a group of the quorum out of sight holds the others in their collective): without
    it the survivors' wait until torchft drops the group read as a job_stall. The eviction
    itself now explains it. A live monitor swept by hand, simulated ranks, a real Lighthouse
    (tests/test_monitor_network.py's driver)."""
    from tests.test_monitor_network import Clock, Driver, Training, monitor

    job = SimJob(4, ranks_per_group=2, heartbeat_timeout_ms=1000)
    mon = None
    try:
        clock = Clock()
        mon = monitor(tmp_path, job, clock)
        d = Driver(mon, Training(job), clock)
        d.sweeps(4)
        assert mon.evict_manual(3, "test")["decision"] == "evict"
        assert job.kills == [job.replica_ids[3]]  # its ranks stop answering
        d.train.stall(4.0, d.clock.t)  # the others wait for it in the cross-group all_reduce
        d.sweeps(8, steps=0)
        assert d.open_kinds() == []
        # the goodput ledger: the eviction's one incident, no job-wide one beside it
        assert [i["kind"] for i in goodput_json(mon)["incidents"]] == ["manual"]
    finally:
        if mon is not None:
            mon.stop()
        job.stop()
