"""When a finding closes: not on one sweep the monitor misses its group (``left_job`` waits for
--dead-sweeps), and a job-wide one when the quorum no longer has two groups (``quorum_shrunk``,
for --dead-sweeps: a heal or a skewed sweep is no shrink) or its stall was left behind by a
restart (``restarted``, ``no_quorum``); none while the monitor reaches no rank at all. Views are built the
way the service builds them (tests/test_monitor_detectors.py's Job)."""

from __future__ import annotations

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_monitor_detectors import T0, Job, run, sweep, update


def test_one_sweep_the_monitor_misses_a_straggler_group_keeps_its_finding():
    """A straggler group whose ranks time out for one sweep (a blip, dead_sweeps 3) is still
    the same episode when it answers late again: one finding, never closed and opened anew."""
    job = Job()
    det = Detectors(DetectorConfig(straggler_steps=6, straggler_windows=2, dead_sweeps=3))
    job.steps(10, now=T0)
    sweep(det, job, T0)
    found, now = run(det, job, 5, T0, late_group={1: 0.5})
    assert [(f.kind, f.replica_group) for _, f in found] == [("straggler", 1)]
    f = found[0][1]
    job.down = set(job.members(1))  # one sweep: every rank of group 1 times out
    found, now = run(det, job, 1, now, late_group={1: 0.5})
    assert found == [] and det.open_findings() == [f]
    job.down = set()
    found, now = run(det, job, 3, now, late_group={1: 0.5})  # back, late again
    assert found == [], [(x.kind, x.replica_group) for _, x in found]
    assert det.open_findings() == [f] and det.resolved_findings() == []
    assert f.evidence["steps"][1] == job.step - 1  # refreshed by the newer window


def test_a_group_out_of_reach_for_dead_sweeps_has_left_the_job():
    job = Job()
    det = Detectors(DetectorConfig(straggler_steps=6, straggler_windows=2, dead_sweeps=2))
    job.steps(10, now=T0)
    sweep(det, job, T0)
    found, now = run(det, job, 5, T0, late_group={1: 0.5})
    (f,) = [f for _, f in found]
    job.down = set(job.members(1))
    run(det, job, 2, now)
    assert f.resolution == "left_job" and f not in det.open_findings()


def slow_network(job: Job, n: int, now: float, extra: float = 0.4, **kw) -> None:
    """``n`` steps in which every group waits ``extra`` s more in the cross-group all_reduce
    (one host's network slows them all alike)."""
    job.steps(n, now=now, **kw)
    for s in job.states:
        t = s["timing"]
        for row in t["recent"][-n:]:
            row["wait_cross_s"] += extra
            row["step_s"] += extra
        s["recent_step_seconds"] = [r["step_s"] for r in t["recent"]]


def quorum_without(job: Job, gone: int, quorum_id: int) -> None:
    """Group ``gone`` stops answering and torchft forms the next quorum without it."""
    job.down = set(job.members(gone))
    for r, s in enumerate(job.states):
        if job.group_of(r) != gone:
            s.update(quorum_id=quorum_id, num_participants=job.n - 1)


def test_job_slow_on_a_quorum_shrunk_to_one_group_is_resolved_and_probes_stop():
    job = Job(groups=2)
    det = Detectors(DetectorConfig(straggler_steps=6, dead_sweeps=2))
    now = T0
    for _ in range(16):  # the healthy baseline
        now += 1.0
        job.steps(3, now=now, noise=0.01)
        assert sweep(det, job, now) == []
    kinds = []
    for _ in range(8):
        now += 1.0
        slow_network(job, 3, now, noise=0.01)
        kinds += [f.kind for f in sweep(det, job, now)]
    assert kinds == ["job_slow"] and det.probes_wanted()
    (f,) = det.job_findings()
    quorum_without(job, 1, 4)
    for _ in range(4):  # the network still slow: no window is judged with one group
        now += 1.0
        slow_network(job, 3, now, noise=0.01)
        sweep(det, job, now)
    assert f.resolution == "quorum_shrunk" and det.job_findings() == []
    assert not det.probes_wanted()


def test_a_straggler_left_alone_in_the_quorum_is_resolved():
    job = Job(groups=2)
    det = Detectors(DetectorConfig(straggler_steps=6, straggler_windows=2, dead_sweeps=2))
    job.steps(10, now=T0)
    sweep(det, job, T0)
    found, now = run(det, job, 5, T0, late_group={0: 0.5})
    (f,) = [f for _, f in found if f.kind == "straggler"]
    assert f.replica_group == 0
    quorum_without(job, 1, 4)
    run(det, job, 3, now, late_group={0: 0.5})
    assert f.resolution == "quorum_shrunk"
    assert [x.kind for x in det.open_findings() if x.kind == "straggler"] == []


def test_one_sweep_the_monitor_reaches_no_group_closes_no_job_finding():
    """Nobody answers for a sweep (dead_sweeps 3): the quorum is the groups' last answers'."""
    job = Job(groups=2)
    det = Detectors(DetectorConfig(straggler_steps=6, dead_sweeps=3))
    now = T0
    for _ in range(16):
        now += 1.0
        job.steps(3, now=now, noise=0.01)
        sweep(det, job, now)
    for _ in range(8):
        now += 1.0
        slow_network(job, 3, now, noise=0.01)
        sweep(det, job, now)
    (f,) = det.job_findings()
    job.down = set(range(job.world))
    now += 1.0
    sweep(det, job, now)
    assert det.job_findings() == [f] and f.resolved_at is None


def stalled(job: Job, det: Detectors, now: float, step: int) -> float:
    """Every rank of every group blocked in the cross-group all_reduce at ``step``: job_stall."""
    job.step = step - 12
    for _ in range(4):
        now += 1.0
        job.steps(3, now=now, noise=0.01)
        sweep(det, job, now)
    for r in range(job.world):
        job.wait(r, "cross", 5.0, phase="allreduce")
    for _ in range(2):
        now += 1.0
        sweep(det, job, now)
    (f,) = det.job_findings()
    assert f.kind == "job_stall" and f.evidence["step"] == step, f.evidence
    return now


def cut_round(hosts: list[str], cut: set[str], at: float):
    """A full probe round in which every link of the hosts in ``cut`` failed."""
    from monitor.evidence.probes import HostProbe, ProbeRound

    probes = {}
    for h in hosts:
        p = HostProbe(h, f"http://{h}:1", 0, {o: f"http://{o}:1" for o in hosts if o != h},
                      status=200)
        p.results = {o: ({"ok": False, "mbit_s": None, "error": "refused"} if {h, o} & cut
                         else {"ok": True, "mbit_s": 900.0, "error": None})
                     for o in hosts if o != h}
        probes[h] = p
    return ProbeRound(at - 0.5, at, probes)


@pytest.mark.parametrize("checkpoint,per_sweep", [(1000, 3), (1500, 0)])
def test_a_job_stall_left_behind_by_a_restart_from_a_checkpoint_is_resolved(checkpoint,
                                                                            per_sweep):
    """Stalled at step 1500; every group stopped and started again (new replica ids) from a
    checkpoint, training on from step 1000 (or not yet past the checkpoint of step 1500): the
    stall is over (``restarted``), and a probe round naming a host confirms no network
    finding."""
    job = Job()
    det = Detectors(DetectorConfig(straggler_steps=6, hang_floor_s=1.0, dead_sweeps=2))
    now = stalled(job, det, T0, 1500)
    (f,) = det.job_findings()
    for s in job.states:  # stopped (a planned stop: no group found dead)
        s.update(finished=True, stopped_by="SIGTERM", phase="stopped")
    now += 1.0
    sweep(det, job, now)
    assert det.job_findings() == [f]
    job.step = checkpoint
    for r, s in enumerate(job.states):  # started again at the same addresses
        s.update(replica_id=f"replica_group_{job.group_of(r)}:again", finished=False,
                 stopped_by=None, quorum_id=9, pid=s["pid"] + 100, started_at=now)
        s["timing"].update(recent=[], waiting=None, last_step=None)
    hosts = sorted({s["host"] for s in job.states})
    for _ in range(3):
        now += 1.0
        job.steps(per_sweep, now=now, noise=0.01)
        view = job.view(now)
        det.update(view.evidence(), None, now, full_view=view)
        det.network(view, cut_round(hosts, {"host-g1"}, now), now, None)
    assert f.resolution == "restarted" and det.job_findings() == []
    assert [x for x in det.open_findings() if x.kind == "network"] == []
    assert not det.probes_wanted()


def test_a_job_stall_the_monitor_reaches_no_rank_of_stays_until_its_ranks_are_forgotten():
    """Every rank out of reach for --dead-sweeps and more: the monitor may be the one cut off
    (a blackout), so the stall stays open; once the ranks are forgotten (no longer targets), no
    quorum is left and it ends ``no_quorum`` after --dead-sweeps."""
    job = Job()
    det = Detectors(DetectorConfig(straggler_steps=6, hang_floor_s=1.0, dead_sweeps=3))
    now = stalled(job, det, T0, 1500)
    (f,) = det.job_findings()
    job.down = set(range(job.world))
    for _ in range(5):
        now += 1.0
        sweep(det, job, now)
    assert det.job_findings() == [f]  # blind: still open
    for _ in range(2):
        now += 1.0
        det.update(job.vb.update([], {}, now=now), None, now)  # no target left
    assert det.job_findings() == [f]
    now += 1.0
    det.update(job.vb.update([], {}, now=now), None, now)
    assert f.resolution == "no_quorum" and det.job_findings() == []


def late_straggler(job: Job, det: Detectors, g: int) -> tuple[object, float]:
    """Group ``g`` found a straggler (whole group 0.5 s late)."""
    job.steps(10, now=T0)
    sweep(det, job, T0)
    found, now = run(det, job, 5, T0, late_group={g: 0.5})
    (f,) = [f for _, f in found if f.kind == "straggler"]
    assert f.replica_group == g
    return f, now


def test_a_heal_in_a_two_group_job_keeps_the_straggler_finding():
    """Group 0 a straggler (eviction held: --min-replicas 2). Group 1 restarts and heals into
    quorum 4 (participating false while it does): the quorum still has both groups. Group 0,
    late throughout, keeps its one finding: no second offence for its host."""
    job = Job(groups=2)
    det = Detectors(DetectorConfig(straggler_steps=6, straggler_windows=2, dead_sweeps=3))
    f, now = late_straggler(job, det, 0)
    for r in job.members(1):
        s = job.states[r]
        s.update(replica_id=s["replica_id"] + ":again", participating=False, phase="healing")
    for s in job.states:
        s.update(quorum_id=4)
    found, now = run(det, job, 2, now, late_group={0: 0.5})
    for r in job.members(1):
        job.states[r].update(participating=True)
    found += run(det, job, 6, now, late_group={0: 0.5})[0]
    assert [x for _, x in found if x.kind == "straggler"] == []
    assert f.resolved_at is None
    assert [x for x in det.open_findings() if x.kind == "straggler"] == [f]


def test_one_sweep_of_skewed_quorum_ids_keeps_the_straggler_finding():
    """3 groups; for one sweep group 0 already reports the next quorum's id, the others not
    yet: no shrink, the same finding stays."""
    job = Job(groups=3)
    det = Detectors(DetectorConfig(straggler_steps=6, straggler_windows=2, dead_sweeps=3))
    f, now = late_straggler(job, det, 0)
    for r in job.members(0):
        job.states[r].update(quorum_id=4)
    found, now = run(det, job, 1, now, late_group={0: 0.5})
    for s in job.states:
        s.update(quorum_id=4)
    found += run(det, job, 6, now, late_group={0: 0.5})[0]
    assert [x for _, x in found if x.kind == "straggler"] == []
    assert f.resolved_at is None and f in det.open_findings()


def test_a_group_dead_at_an_old_quorum_id_shrinks_no_quorum_after_a_lighthouse_restart():
    """Group 2 died at quorum 3 (its URLs stay targets); the Lighthouse restarted and numbers
    quorums from 1 again. Group 1 missing one sweep does not shrink the quorum to the dead
    group's old one: group 0's straggler finding stays."""
    job = Job(groups=3)
    det = Detectors(DetectorConfig(straggler_steps=6, straggler_windows=2, dead_sweeps=3))
    job.steps(10, now=T0)
    sweep(det, job, T0)
    job.down = set(job.members(2))
    for r in job.members(0) + job.members(1):
        job.states[r].update(quorum_id=1, num_participants=2)
    found, now = run(det, job, 8, T0, late_group={0: 0.5})
    (f,) = [x for _, x in found if x.kind == "straggler"]
    job.down = set(job.members(2)) | set(job.members(1))  # group 1 times out one sweep
    found, now = run(det, job, 1, now, late_group={0: 0.5})
    job.down = set(job.members(2))
    found += run(det, job, 6, now, late_group={0: 0.5})[0]
    assert [x for _, x in found if x.kind == "straggler"] == []
    assert f.resolved_at is None and f in det.open_findings()


def test_a_blackout_of_the_monitor_closes_no_finding():
    """The monitor's own link drops for --dead-sweeps sweeps and more (no rank answers): the
    straggler finding is not ``left_job``; when the link is back it is the same one."""
    job = Job(groups=3)
    det = Detectors(DetectorConfig(straggler_steps=6, straggler_windows=2, dead_sweeps=3))
    f, now = late_straggler(job, det, 1)
    job.down = set(range(job.world))
    run(det, job, 4, now, late_group={1: 0.5})
    assert f.resolved_at is None
    job.down = set()
    found, now = run(det, job, 4, now + 4, late_group={1: 0.5})
    assert [x for _, x in found if x.kind == "straggler"] == []
    assert f.resolved_at is None and f in det.open_findings()


def test_a_monitor_told_it_is_blind_closes_no_finding_of_the_groups_it_misses():
    """Reaching only some ranks (under --min-reachable: ``blind``), the groups out of sight
    have not left the job for --dead-sweeps sweeps; seen, the same rule closes them."""
    job = Job(groups=3)
    det = Detectors(DetectorConfig(straggler_steps=6, straggler_windows=2, dead_sweeps=2))
    f, now = late_straggler(job, det, 1)
    job.down = set(job.members(1)) | set(job.members(2))
    for _ in range(3):
        now += 1.0
        update(det, job, now, blind="reaches 33% of the ranks")
    assert f.resolved_at is None
    now += 1.0
    update(det, job, now)
    assert f.resolution == "left_job"
