"""A straggler across a monitor restart on its ``--state``: the restart closes its finding
(``monitor_restarted``) and the restarted monitor finds it again. One still late keeps its
onset (``first_seen``: the incident bundle's onset, monitor/analysis/bundle.py), not the start
of its late run in the restarted monitor's first window; one that caught up meanwhile is found
anew on its own onset if it falls behind again.

A real Monitor over a real torchft Lighthouse that simulated groups join, their ranks' per-step
timings written by the test (tests/test_monitor_network.py's ``Training``), a dry run (the
straggler stays), swept one simulated second at a time."""

from __future__ import annotations

import pytest

from monitor.config import RailsConfig
from tests.support.monitor_sim import SimJob
from tests.test_monitor_network import LATE, Clock, Driver, monitor, straggling


@pytest.fixture
def job():
    j = SimJob(3, ranks_per_group=1, heartbeat_timeout_ms=1000)
    yield j
    j.stop()


def restarted(tmp_path, job, d: Driver) -> Driver:
    d.mon.stop()
    return Driver(monitor(tmp_path, job, d.clock,
                          rails=RailsConfig(min_replicas=1, cooldown_s=0, dry_run=True)),
                  d.train, d.clock)


def stragglers(d: Driver) -> list[dict]:
    """The audit log's straggler findings, oldest first."""
    return sorted((f for f in d.mon.store.findings() if f["kind"] == "straggler"),
                  key=lambda f: f["id"])


def test_a_straggler_still_late_after_a_restart_keeps_its_onset(tmp_path, job):
    clock = Clock()
    d = straggling(tmp_path, job, clock, LATE)
    d.sweeps(6, groups=LATE, wait_cross_s=0.36)  # late on: its onset many windows back
    [before] = stragglers(d)
    d = restarted(tmp_path, job, d)
    try:
        d.until(lambda: "straggler" in d.open_kinds(), "the straggler found again",
                groups=LATE, wait_cross_s=0.36)
        old, new = stragglers(d)
        assert (old["id"], old["resolution"]) == (before["id"], "monitor_restarted")
        assert (new["replica_group"], new["replica_id"]) == (0, before["replica_id"])
        assert new["resolved_at"] is None and new["confirmed_at"] > old["resolved_at"]
        assert new["first_seen"] == before["first_seen"]
    finally:
        d.mon.stop()


def test_a_straggler_that_caught_up_over_a_restart_is_found_anew_on_its_own_onset(
        tmp_path, job):
    clock = Clock()
    d = straggling(tmp_path, job, clock, LATE)
    [before] = stragglers(d)
    d = restarted(tmp_path, job, d)
    restart_at = clock.t
    try:
        d.sweeps(6)  # on time: judged so in the restarted monitor's windows
        assert "straggler" not in d.open_kinds()
        d.until(lambda: "straggler" in d.open_kinds(), "the straggler late again",
                groups=LATE, wait_cross_s=0.36)
        old, new = stragglers(d)
        assert (old["id"], old["resolution"]) == (before["id"], "monitor_restarted")
        # its late run read back from its ranks' step seconds, within the 6 s it was on time
        assert new["first_seen"] > restart_at
    finally:
        d.mon.stop()
