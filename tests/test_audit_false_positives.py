"""Healthy jobs meeting what production throws at them must not read as faults.

Built like tests/test_monitor_network.py: a real Monitor against a real torchft Lighthouse that
simulated groups join (tests/support/monitor_sim.py), the ranks' timings written by the test.
"""

from __future__ import annotations

import pytest

from tests.support.monitor_sim import SimJob
from tests.test_monitor_network import Clock, Driver, Training, monitor


@pytest.fixture
def job(request):
    j = SimJob(4, ranks_per_group=getattr(request, "param", 2), heartbeat_timeout_ms=1000)
    yield j
    j.stop()


def _wait_for_quorum(job, waiting_s: float, now: float) -> None:
    """Every rank waiting for its next quorum for ``waiting_s``: a one-rank group in its explicit
    wait_quorum, a multi-rank group blocked in its synchronous start_quorum (phase ``quorum``,
    the wait timed across groups)."""
    for r in job.sim.ranks:
        r.update(phase="quorum", phase_since=now - waiting_s,
                 timing={**r.state["timing"], "waiting": {"scope": "cross", "seconds": waiting_s}})


def _reached_stall(d, reached: str) -> None:
    """Every rank blocked in the allreduce with the Lighthouse unreadable by the monitor but
    shown reached by the ranks (``reached`` in the summary): a network job_stall."""
    d.train.stall(4.0, d.clock.t)
    d.sweeps(2, steps=0)
    (f,) = d.mon.detectors.job_findings()
    assert f.kind == "job_stall" and f.evidence["lighthouse_unreadable"] is True
    assert "network fault" in f.evidence["summary"] and reached in f.evidence["summary"]


@pytest.mark.parametrize("job,phase", [(2, "allreduce"), (2, "quorum"), (1, "quorum")],
                         indirect=["job"])
def test_a_stall_while_the_lighthouse_is_down_names_the_lighthouse_not_the_network(tmp_path, job,
                                                                                  phase):
    """The Lighthouse restarted: every rank waits for its quorum, in torchft's allreduce (which
    first waits for it: measured on a real 3-group job) or in the quorum call itself (phase
    ``quorum``, any group size); the finding must not send the operator looking for a network
    fault."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        job.front_down()  # the monitor cannot read the Lighthouse: the job's ranks neither
        if phase == "quorum":
            _wait_for_quorum(job, 4.0, d.clock.t)
        else:
            d.train.stall(4.0, d.clock.t)
        d.sweeps(2, steps=0)
        (f,) = d.mon.detectors.job_findings()
        assert f.kind == "job_stall"
        assert "network fault" not in f.evidence["summary"]
        assert "the Lighthouse does not answer" in f.evidence["summary"]
        assert f.evidence["lighthouse_unreadable"] is True
        job.front_up()
        d.sweep()  # a step moved: over
        assert d.open_kinds() == []
    finally:
        d.mon.stop()


def test_groups_waiting_for_their_quorum_with_the_lighthouse_readable_are_no_job_stall(
        tmp_path, job):
    """The Lighthouse answers: every group waiting for its quorum is torchft forming one, not a
    job-wide stall (nor a reason to probe the network)."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        _wait_for_quorum(job, 4.0, d.clock.t)
        d.sweeps(3, steps=0)
        assert d.open_kinds() == []
        assert not d.mon.detectors.probes_wanted()
    finally:
        d.mon.stop()


def test_groups_stepping_with_the_lighthouse_down_are_no_job_stall(tmp_path, job):
    """Steps move while each sweep finds every rank in a long quorum wait (the Lighthouse out of
    the monitor's reach only), then stop with every rank still waiting past the hang threshold:
    the steps committed since the outage show the ranks reach the Lighthouse, so no stall."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        job.front_down()
        for _ in range(3):
            d.clock.t += 1.0
            d.train.steps(1, d.clock.t)
            _wait_for_quorum(job, 4.0, d.clock.t)
            d.mon.sweep_once()
            assert d.mon.last_sweep_error is None and d.mon.detectors.last_error is None
        for _ in range(3):  # no step now: stalled long enough for a job_stall but for the rule
            d.clock.t += 1.0
            _wait_for_quorum(job, 4.0, d.clock.t)
            d.mon.sweep_once()
            assert d.mon.last_sweep_error is None and d.mon.detectors.last_error is None
        assert d.open_kinds() == []
        assert not d.mon.detectors.probes_wanted()
    finally:
        d.mon.stop()


def test_a_quorum_wait_after_steps_committed_while_the_lighthouse_is_unreadable_is_no_stall(
        tmp_path, job):
    """Only the monitor lost the Lighthouse (its /status read fails): the job commits steps, which
    needs a quorum, so the ranks reach it. A quorum wait past the hang threshold then (survivors
    waiting out a heartbeat timeout, a reconfigure) is torchft's own, no job_stall blaming the
    Lighthouse; a stall in the collective is still one, naming the network."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        job.front_down()
        d.sweeps(6)  # steps commit: the ranks reach the Lighthouse
        _wait_for_quorum(job, 4.0, d.clock.t)
        d.sweeps(2, steps=0)
        assert d.mon.detectors.job_findings() == []
        assert not d.mon.detectors.probes_wanted()
        assert d.mon.last_sweep_error is None and d.mon.detectors.last_error is None
        _reached_stall(d, "the ranks reach it")  # every rank blocked in the allreduce itself
    finally:
        d.mon.stop()


@pytest.mark.parametrize("quiet_sweeps", [1, 4])  # a short step, a step longer than 4 sweeps
def test_a_step_already_past_its_quorum_when_the_lighthouse_went_down_proves_nothing(
        tmp_path, job, quiet_sweeps):
    """The step that had its quorum before the Lighthouse went down still commits, however many
    sweeps later: the quorum wait that follows is still the Lighthouse's."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        job.front_down()
        d.sweeps(quiet_sweeps, steps=0)
        d.sweep(steps=1)
        _wait_for_quorum(job, 4.0, d.clock.t)
        d.sweeps(2, steps=0)
        (f,) = d.mon.detectors.job_findings()
        assert f.kind == "job_stall" and "the Lighthouse does not answer" in f.evidence["summary"]
    finally:
        d.mon.stop()


@pytest.mark.parametrize("phase", ["quorum", "allreduce"])
def test_the_quorum_of_the_step_in_flight_reported_after_the_outage_began_proves_nothing(
        tmp_path, job, phase):
    """The step in flight got its quorum before the Lighthouse went down, but the ranks report
    its new quorum id only after the monitor noticed the outage: that quorum formed before, so
    the stall that follows is still the Lighthouse's."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        q = job.sim.group(0)[0].state["quorum_id"]
        job.front_down()
        d.sweep(steps=0)  # the monitor notes the outage at quorum q
        for r in job.sim.ranks:
            r.update(quorum_id=q + 1)
        d.sweep(steps=1)  # the step in flight commits
        if phase == "quorum":
            _wait_for_quorum(job, 4.0, d.clock.t)
        else:
            d.train.stall(4.0, d.clock.t)
        d.sweeps(2, steps=0)
        (f,) = d.mon.detectors.job_findings()
        assert f.kind == "job_stall" and f.evidence["quorum_id"] == q + 1
        assert "the Lighthouse does not answer the monitor either" in f.evidence["summary"]
        assert "network fault" not in f.evidence["summary"]
    finally:
        d.mon.stop()


def test_a_second_quorum_during_the_outage_shows_the_ranks_reach_the_lighthouse(tmp_path, job):
    """A quorum beyond the one of the step in flight formed during the monitor's outage: the
    ranks reach the Lighthouse, so a stall in the collective names the network, and says why."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        q = job.sim.group(0)[0].state["quorum_id"]
        job.front_down()
        d.sweep(steps=0)
        for r in job.sim.ranks:
            r.update(quorum_id=q + 1)
        d.sweep(steps=1)
        for r in job.sim.ranks:
            r.update(quorum_id=q + 2)
        _reached_stall(d, "a new quorum formed since: the ranks reach it")
    finally:
        d.mon.stop()


def test_a_stall_that_named_the_lighthouse_keeps_it_until_a_step_commits(tmp_path, job):
    """The Lighthouse answers the monitor again while every rank still waits for the quorum it
    has not re-formed yet: the same stall, still the Lighthouse's, open and then resolved."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)

    def named(f) -> bool:
        return (f.evidence["lighthouse_unreadable"] is True
                and "the ranks may be waiting for their quorum" in f.evidence["summary"]
                and "network fault" not in f.evidence["summary"])

    try:
        d.sweeps(4)
        job.front_down()
        d.sweep(steps=0)
        d.train.stall(4.0, d.clock.t)
        d.sweeps(2, steps=0)
        (f,) = d.mon.detectors.job_findings()
        assert named(f)
        job.front_up()
        d.train.stall(6.0, d.clock.t)
        d.sweep(steps=0)
        assert all(r.verdict[1] != "lighthouse_unreadable"
                   for r in d.mon.view.evidence().ranks.values())  # read again
        (f,) = d.mon.detectors.job_findings()
        assert named(f)
        d.sweep(steps=1)
        assert d.mon.detectors.job_findings() == []
        (done,) = [f for f in d.mon.detectors.resolved_findings() if f.kind == "job_stall"]
        assert done.resolution == "progress" and named(done)
    finally:
        d.mon.stop()


def test_a_network_stall_the_monitor_then_loses_the_lighthouse_in_stays_a_network_stall(
        tmp_path, job):
    """Every group stalls in the cross-group collective while the Lighthouse is readable, then
    the monitor loses the Lighthouse too (often the same fault): the stall began before the
    outage, so it is not the Lighthouse's, during the outage or after it."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)

    def network() -> bool:
        (f,) = d.mon.detectors.job_findings()
        return (f.evidence["cause"] == "network" and "network fault" in f.evidence["summary"]
                and "may be waiting for their quorum" not in f.evidence["summary"])

    try:
        d.sweeps(4)
        d.train.stall(4.0, d.clock.t)
        d.sweeps(2, steps=0)
        assert network()
        job.front_down()
        d.train.stall(12.0, d.clock.t)
        d.sweeps(2, steps=0)
        assert network()
        job.front_up()
        d.train.stall(14.0, d.clock.t)
        d.sweeps(2, steps=0)
        assert network()
    finally:
        d.mon.stop()


def _wait_cross(r, phase: str, waiting_s: float, now: float, **state) -> None:
    r.update(phase=phase, phase_since=now - waiting_s, **state,
             timing={**r.state["timing"], "waiting": {"scope": "cross", "seconds": waiting_s}})


@pytest.mark.parametrize("joiner", [False, True])
def test_an_outage_noticed_a_long_sweep_late_dates_from_the_last_read(tmp_path, job, joiner):
    """The Lighthouse goes right after a sweep read it and the next sweep comes 20 s later (a
    long --interval or sweep); the ranks wait for their quorum since: the Lighthouse's stall, not
    the network's. A group restarted 10 s into the outage, its first allreduce waiting for its
    quorum, needs the Lighthouse as much: it holds nobody."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        read_at, q = d.clock.t, job.sim.group(0)[0].state["quorum_id"]
        job.front_down()
        d.clock.t += 19.0
        for _ in range(3):
            now = d.clock.t + 1.0  # the next sweep's
            d.train.stall(now - read_at - 0.5, now)
            if joiner:
                for r in job.sim.group(3):
                    _wait_cross(r, "allreduce", now - read_at - 10.0, now, quorum_id=q - 1)
            d.sweep(steps=0)
        (f,) = d.mon.detectors.job_findings()
        assert f.evidence["cause"] == "lighthouse", f.evidence["summary"]
        assert "network fault" not in f.evidence["summary"]
    finally:
        d.mon.stop()


def test_a_lighthouse_stall_whose_ranks_then_form_a_new_quorum_names_the_network(tmp_path, job):
    """A stall named the Lighthouse's; it answers again and the ranks form a new quorum at the
    same step, then block in its allreduce: that needed the Lighthouse, so the network's."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        job.front_down()
        d.sweep(steps=0)
        d.train.stall(4.0, d.clock.t)
        d.sweeps(2, steps=0)
        (f,) = d.mon.detectors.job_findings()
        assert f.evidence["cause"] == "lighthouse"
        job.front_up()
        job.alive.discard(3)  # a quorum of the other groups: a new quorum id
        job.requorum()
        for i in range(3):
            d.train.stall(5.0 + i, d.clock.t + 1.0)
            d.sweep(steps=0)
        (f,) = d.mon.detectors.job_findings()
        assert f.evidence["cause"] == "network" and len(f.evidence["groups"]) == 3
        assert "network fault" in f.evidence["summary"]
        assert "may be waiting for their quorum" not in f.evidence["summary"]
    finally:
        d.mon.stop()


def test_groups_through_the_collective_after_a_stall_confirmed_keep_it_open(tmp_path, job):
    """Three groups get their part of the stalled allreduce through after the stall is confirmed
    (a step ahead, waiting for a quorum), one still blocked in it: no step committed job-wide,
    the same stall (one finding, one row), over once the job steps on."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        d.train.stall(4.0, d.clock.t)
        d.sweeps(2, steps=0)
        (f,) = d.mon.detectors.job_findings()
        for g in (0, 1, 2):
            for r in job.sim.group(g):
                r.update(step=d.train.step + 1, phase="quorum", phase_since=d.clock.t,
                         timing={**r.state["timing"], "waiting": None})
        for i in range(3):
            for r in job.sim.group(3):
                _wait_cross(r, "allreduce", 7.0 + i, d.clock.t + 1.0)
            d.sweep(steps=0)
            assert d.mon.detectors.job_findings() == [f]
        assert sorted(f.evidence["groups"]) == ["0", "1", "2", "3"]
        d.sweep(steps=2)
        assert d.mon.detectors.job_findings() == []
        assert [(r["kind"], r["resolution"]) for r in d.mon.store.findings()] == [
            ("job_stall", "progress")]
    finally:
        d.mon.stop()


@pytest.mark.parametrize("phase", ["allreduce", "quorum"])
@pytest.mark.parametrize("joiner_s,stall", [(8.0, False), (60.0, True)])
def test_a_group_joining_holds_the_others_in_either_phase_with_the_lighthouse_down(
        tmp_path, job, phase, joiner_s, stall):
    """The monitor cannot read the Lighthouse; a group outside the newest quorum asks for its own
    since the others began waiting (joining: recovery, no stall), whether the others wait in the
    allreduce or in their quorum call. One asking since long before holds nobody: a stall."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        job.front_down()
        q = job.sim.group(0)[0].state["quorum_id"]
        for g in range(4):
            for r in job.sim.group(g):
                if g == 3:
                    _wait_cross(r, "quorum", joiner_s, d.clock.t, quorum_id=q - 1)
                else:
                    _wait_cross(r, phase, 8.0, d.clock.t)
        d.sweeps(2, steps=0)
        assert [f.kind for f in d.mon.detectors.job_findings()] == (["job_stall"] if stall else [])
    finally:
        d.mon.stop()


def test_a_group_asking_only_since_the_lighthouse_went_holds_nobody(tmp_path, job):
    """A group restarted during a Lighthouse outage asks for a quorum the dead Lighthouse cannot
    give it either: it holds none of the others, whose quorum wait is the Lighthouse's."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        job.front_down()
        d.sweep(steps=0)  # the monitor notes the outage
        d.clock.t += 55.0
        q = job.sim.group(0)[0].state["quorum_id"]
        for g in range(4):
            for r in job.sim.group(g):
                if g == 3:  # restarted 10 s ago, asking since
                    _wait_cross(r, "quorum", 10.0, d.clock.t, quorum_id=q - 1)
                else:
                    _wait_cross(r, "quorum", 60.0, d.clock.t)
        d.sweeps(2, steps=0)
        (f,) = d.mon.detectors.job_findings()
        assert f.kind == "job_stall" and "the Lighthouse does not answer" in f.evidence["summary"]
    finally:
        d.mon.stop()


def test_a_group_healing_from_a_peer_is_no_job_stall(tmp_path, job):
    """A restarted group heals: torchft receives the peer's checkpoint in its quorum thread, and
    its allreduce waits for that (shown blocked in the cross-group collective, its quorum not
    known yet) while every other group waits for it in the all_reduce. On a real model that
    takes longer than the hang threshold; it is torchft's recovery, not a network fault."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        d.train.stall(4.0, d.clock.t)
        for r in job.sim.group(3):  # its quorum not known yet: its allreduce still waits for it
            r.update(quorum_id=-1, step=0)
        d.sweeps(3, steps=0)
        assert d.open_kinds() == []
        assert d.mon.store.decisions() == []
    finally:
        d.mon.stop()


def test_a_group_restarted_and_healing_while_only_the_monitor_lost_the_lighthouse_is_no_stall(
        tmp_path, job):
    """Only the monitor cannot read the Lighthouse (steps commit); a group restarts at the same
    addresses (a new process) and heals while the others wait for it in the all_reduce. The new
    process cannot be verified, so it is no evidence, but it holds the others all the same:
    recovery, no job_stall sending the operator to the network."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        job.front_down()
        d.sweeps(4)  # steps commit: the ranks reach the Lighthouse
        d.train.stall(4.0, d.clock.t)
        for r in job.sim.group(3):  # restarted, healing: its quorum not known yet
            r.update(quorum_id=-1, step=0, pid=r.state["pid"] + 5000,
                     started_at=d.clock.t - 5)
        d.sweeps(3, steps=0)
        assert 3 not in d.mon.view.evidence().groups  # the new process is no evidence
        assert d.open_kinds() == []
        assert not d.mon.detectors.probes_wanted()
    finally:
        d.mon.stop()


def test_a_group_healing_after_a_cold_first_step_still_holds_the_others(tmp_path, job):
    """torchft's async quorum: a restarted group asks for its quorum, runs a slow first forward
    and backward (CUDA start-up, compilation), and reaches its allreduce long after the others
    began waiting there; its quorum still heals in the background. Recovery, no job_stall."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        d.train.stall(14.0, d.clock.t)
        for r in job.sim.group(3):  # restarted, in its allreduce for 4 s: its quorum healing
            _wait_cross(r, "allreduce", 4.0, d.clock.t, quorum_id=-1, step=0,
                        pid=r.state["pid"] + 5000, started_at=d.clock.t - 30)
        d.sweeps(3, steps=0)
        assert d.open_kinds() == []
    finally:
        d.mon.stop()


def test_a_group_crash_looping_while_only_the_monitor_lost_the_lighthouse_holds_nobody(
        tmp_path, job):
    """As above, but group 3 restarts again and again (each process asks for its quorum only
    for the last half second) while the others' stall grows: a group that began asking long
    after the others began waiting is not what they wait for, so the network stall is found."""
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    try:
        d.sweeps(4)
        job.front_down()
        d.sweeps(4)  # steps commit: the ranks reach the Lighthouse
        for i in range(6):
            d.train.stall(4.0 + 2 * i, d.clock.t)
            for r in job.sim.group(3):  # a new process each time, asking since 0.5 s
                _wait_cross(r, "quorum", 0.5, d.clock.t, quorum_id=-1, step=0,
                            pid=r.state["pid"] + 1000, started_at=d.clock.t - 0.5)
            d.sweep(steps=0)
        (f,) = d.mon.detectors.job_findings()
        assert f.kind == "job_stall" and f.evidence["cause"] == "network"
    finally:
        d.mon.stop()


def test_a_rank_the_monitor_cannot_reach_while_its_group_commits_is_not_dead():
    """The monitor loses its route to one rank (or the rank's WorkerServer is starved) while the
    group trains on: torchft commits a step only with every rank of the group, so the rank
    lives. dead_rank evicts by default: it must not evict a group that keeps committing."""
    from monitor.config import DetectorConfig
    from monitor.detect import Detectors
    from tests.test_monitor_detectors import T0, Job, sweep

    job = Job()
    det = Detectors(DetectorConfig(dead_sweeps=3))
    job.steps(5, now=T0)
    sweep(det, job, T0)
    job.down = {3}  # group 1's rank 1 no longer answers the monitor; the job trains on
    found = []
    for i in range(1, 7):
        job.steps(3, now=T0 + i)
        found += sweep(det, job, T0 + i)
    assert [(f.kind, f.replica_group) for f in found] == []
