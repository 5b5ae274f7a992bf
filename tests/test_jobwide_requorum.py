"""A job in torchft's quorum with the Lighthouse up: a short wait for a quorum, then steps, is no
``job_stall``; a held ``network`` finding is not ``job_recovered`` while no step committed
(docs/monitor.md: Network faults). A real Monitor over a real Lighthouse
(tests/test_monitor_network.py's Driver)."""

from __future__ import annotations

import pytest

from monitor.config import RailsConfig
from tests.support.monitor_sim import SimJob
from tests.test_monitor_network import (
    CUT_OFF,
    TOKEN,
    Clock,
    Driver,
    Training,
    links,
    monitor,
    network_findings,
)


@pytest.fixture
def job():
    j = SimJob(4, ranks_per_group=2, heartbeat_timeout_ms=1000)
    yield j
    j.stop()


def _driver(tmp_path, job, **kw) -> Driver:
    clock, train = Clock(), Training(job)  # names the hosts the links are of
    job.sim.probe_token = TOKEN
    job.sim.links = links(job, "h1", CUT_OFF)
    return Driver(monitor(tmp_path, job, clock, rank_exit_token=TOKEN, **kw), train, clock)


def _in_quorum(d: Driver, secs: float) -> None:
    """Every rank in torchft's quorum call (phase quorum), asking for ``secs``."""
    for r in d.train.job.sim.ranks:
        r.update(phase="quorum", phase_since=d.clock.t - secs,
                 timing={**r.state["timing"], "waiting": {"scope": "cross", "seconds": secs}})


def test_a_short_wait_for_a_quorum_then_steps_is_no_job_stall(tmp_path, job):
    """A rejoin: every group waits in its quorum call a few seconds (one attempt), then steps."""
    d = _driver(tmp_path, job)
    try:
        d.sweeps(4)
        for secs in range(1, 7):
            _in_quorum(d, float(secs - 1))  # as of the sweep, a second on
            d.sweep(steps=0)
        d.sweeps(3)
        assert d.open_kinds() == [] and not d.mon.probes.to_json()["rounds"]
    finally:
        d.mon.stop()


def test_a_held_network_finding_is_not_recovered_while_no_step_commits(tmp_path, job):
    """Group 1's host is cut off, its eviction held by the rails (min_replicas); the job_stall
    then closes without a commit (group 3 found dead explains it): the network finding stays
    open until a step commits."""
    d = _driver(tmp_path, job, rails=RailsConfig(min_replicas=4, cooldown_s=0))
    try:
        d.sweeps(4)
        d.train.stall(4.0, d.clock.t)
        (net,) = d.until(lambda: network_findings(d), "a network finding", steps=0)
        assert job.kills == []  # held
        for r in job.sim.group(3):
            r.set_mode("down")
        job.alive.discard(3)  # its heartbeats stop too
        d.until(lambda: "dead" in d.open_kinds(), "a dead finding", steps=0, pause=0.1,
                sweeps=100)
        d.sweeps(3, steps=0)
        assert not d.mon.detectors.job_findings()
        assert network_findings(d) == [net]
        assert [f["resolution"] for f in d.mon.store.findings()
                if f["kind"] == "network"] == [None]
        d.sweeps(2)  # a step committed: recovered
        assert network_findings(d) == []
        (row,) = [f for f in d.mon.store.findings() if f["kind"] == "network"]
        assert row["resolution"] == "job_recovered"
    finally:
        d.mon.stop()
