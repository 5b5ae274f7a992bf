"""A job in torchft's quorum with the Lighthouse up. Stopped for good: every group's quorum
attempt fails (a rank cut off from its peers fails the process group's configuration) and it
asks again with no step committed: ``job_stall``, and the probe mesh names the host. A rejoin
(one attempt, however long its configuration or heal), or a short wait then steps, is none; a
held ``network`` finding is not ``job_recovered`` while no step committed (docs/monitor.md:
job_stall; Network faults). A real Monitor over a real Lighthouse
(tests/test_monitor_network.py's Driver)."""

from __future__ import annotations

import time
import uuid

import pytest

from monitor.config import RailsConfig
from tests.support.monitor_sim import SimJob
from tests.test_monitor_network import (
    CUT_OFF,
    THROTTLED,
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


def _driver(tmp_path, job, bad: str | None = "h1", link: dict = CUT_OFF, **kw) -> Driver:
    clock, train = Clock(), Training(job)  # names the hosts the links are of
    job.sim.probe_token = TOKEN
    job.sim.links = links(job, bad, link) if bad else links(job)
    return Driver(monitor(tmp_path, job, clock, rank_exit_token=TOKEN, **kw), train, clock)


def _in_quorum(d: Driver, secs: float) -> None:
    """Every rank in torchft's quorum call (phase quorum), asking for ``secs``."""
    for r in d.train.job.sim.ranks:
        r.update(phase="quorum", phase_since=d.clock.t - secs,
                 timing={**r.state["timing"], "waiting": {"scope": "cross", "seconds": secs}})


def _wait(r, phase: str, secs: float, t: float) -> None:
    r.update(phase=phase, phase_since=t - secs,
             timing={**r.state["timing"], "waiting": {"scope": "cross", "seconds": secs}})


def _loop(d: Driver, sweeps: int, period: float = 8.0) -> None:
    """Sweeps (no step) while every group re-asks its quorum every ``period`` s, as torchft
    does when its process group cannot be configured."""
    for _ in range(sweeps):
        _in_quorum(d, (d.clock.t + 1.0 - d.t0) % period)  # as of the sweep's time
        d.sweep(steps=0)


def test_a_quorum_that_keeps_failing_with_the_lighthouse_up_is_a_job_stall(tmp_path, job):
    d = _driver(tmp_path, job, rails=RailsConfig(min_replicas=4, cooldown_s=0))
    try:
        d.sweeps(4)
        step = d.train.step
        d.t0 = d.clock.t
        _loop(d, 7)  # one attempt, still under way: torchft may yet form it (a rejoin)
        assert d.open_kinds() == []
        _loop(d, 3)  # asked again with nothing committed: stopped for good
        (f,) = d.mon.detectors.job_findings()
        assert f.kind == "job_stall" and f.evidence["cause"] == "network"
        assert f.evidence["step"] == step and "asking for its quorum again" in f.evidence[
            "summary"]
        assert f.first_seen <= d.t0 + 1.0
        assert {g["phase"] for g in f.evidence["groups"].values()} == {"quorum"}
        # the probe mesh runs and names the host cut off
        for _ in range(30):
            if network_findings(d):
                break
            d.mon.probes.wait(10)
            _loop(d, 1)
        (net,) = network_findings(d)
        assert net.replica_group == 1 and net.evidence["host"] == "h1"
    finally:
        d.mon.stop()


def test_a_quorum_asked_again_while_a_newer_one_forms_is_no_job_stall_yet(tmp_path, job):
    """The Lighthouse's quorum id past the one the ranks report (group 3 restarted, its ranks
    still in their quorum call too): a new quorum is forming, torchft may yet commit; once the
    ranks report it and still ask again, the job_stall opens."""
    d = _driver(tmp_path, job, rails=RailsConfig(min_replicas=4, cooldown_s=0))
    try:
        d.sweeps(4)
        d.t0 = d.clock.t
        job.replica_ids[3] = f"replica_group_3:{uuid.uuid4()}"
        for r in job.sim.group(3):
            r.update(replica_id=job.replica_ids[3])
        q0, q1 = job.quorum_id, job.requorum()
        assert q1 > q0
        for r in job.sim.ranks:
            r.update(quorum_id=q0)  # still inside start_quorum: the old id reported
        _loop(d, 10)
        assert d.open_kinds() == []
        for r in job.sim.ranks:
            r.update(quorum_id=q1)
        _loop(d, 2)
        assert d.open_kinds() == ["job_stall"]
    finally:
        d.mon.stop()


@pytest.mark.parametrize("joiner,bad,n", [(True, None, 8), (False, None, 8), (True, "h0", 25)])
def test_a_rejoin_configuring_or_healing_after_a_failed_step_is_no_job_stall(
        tmp_path, job, joiner, bad, n):
    """The step after the last commit failed (an eviction's aborted collective: the survivors
    ask for their quorum 10 s after it, group 3 restarted since 5 s after it); the Lighthouse
    forms the next quorum at once and the survivors, still in their quorum call, configure its
    process group and heal (a heal's transfer on a throttled link): one attempt each."""
    d = _driver(tmp_path, job, bad, THROTTLED)
    try:
        d.sweeps(4)
        q0, t_commit = job.quorum_id, d.clock.t
        d.clock.t += 10.0
        if joiner:
            job.replica_ids[3] = f"replica_group_3:{uuid.uuid4()}"
            for r in job.sim.group(3):
                r.update(replica_id=job.replica_ids[3])
        job.requorum()
        for _ in range(n):
            t = d.clock.t + 1.0
            for g in (0, 1, 2) if joiner else (0, 1, 2, 3):
                for r in job.sim.group(g):
                    r.update(quorum_id=q0)  # still inside start_quorum: the old id reported
                    _wait(r, "quorum", t - (t_commit + 10.0), t)
            if joiner:
                for r in job.sim.group(3):
                    r.update(quorum_id=-1, participating=False, step=0)
                    _wait(r, "quorum", t - (t_commit + 5.0), t)
            d.sweep(steps=0)
            time.sleep(0.05)  # probe rounds, if any started, run on their own thread
            assert d.open_kinds() == []
        assert job.kills == [] and not d.mon.probes.to_json()["rounds"]
    finally:
        d.mon.stop()


def test_a_quorum_after_a_failed_steps_collective_is_no_second_attempt(tmp_path, job):
    """Every group seen in its step's quorum, then blocked in the step's collective until it
    fails, then asking again and configuring the quorum for long: the failed step's
    collective between the two, not a failed quorum attempt, so no job_stall."""
    d = _driver(tmp_path, job, None)
    try:
        d.sweeps(4)
        t0 = d.clock.t
        _in_quorum(d, 0.5)
        d.sweep(steps=0)
        d.train.stall(0.3, d.clock.t + 1.0)
        d.sweep(steps=0)
        d.clock.t += 6.0  # the collective fails (a peer's error); nothing swept meanwhile
        for _ in range(12):  # the one attempt after it
            t = d.clock.t + 1.0
            for r in job.sim.ranks:
                _wait(r, "quorum", t - (t0 + 8.0), t)
            d.sweep(steps=0)
        assert d.open_kinds() == []
    finally:
        d.mon.stop()


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
        d.until(lambda: "dead" in d.open_kinds(), "a dead finding", steps=0)
        d.sweeps(3, steps=0)
        assert not d.mon.detectors.job_findings()
        assert network_findings(d) == [net]
        assert [f["resolution"] for f in d.mon.store.findings()
                if f["kind"] == "network"] == [None]
        job.alive.discard(3)
        d.sweeps(2)  # a step committed: recovered
        assert network_findings(d) == []
        (row,) = [f for f in d.mon.store.findings() if f["kind"] == "network"]
        assert row["resolution"] == "job_recovered"
    finally:
        d.mon.stop()
