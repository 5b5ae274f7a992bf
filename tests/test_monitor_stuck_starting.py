"""A rank that never reaches its first quorum is reported as ``stuck_starting``, not evicted;
so is a verified group the job's quorums go on without (its step unmoved for --starting-timeout
while the others commit steps), on synthetic views.

Real parts: a torchft Lighthouse the monitor verifies against, and a real trainer rank whose own
Lighthouse address is unreachable (torchft's Manager sits in its connect, for up to
``--connect-timeout``): its WorkerServer answers ``phase: starting``, ``quorum_id: -1``, no
replica id. Such a rank cannot be verified, so only the monitor's full view (not the evidence the
other detectors see) has it; the finding carries no replica id, so nothing could be evicted.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightkeeper.cluster import LocalCluster
from lightkeeper.processes import stop_process, wait_until
from monitor.config import DetectorConfig, MonitorConfig
from monitor.detect import Detectors
from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.evidence.verification import UNVERIFIED, VERIFIED, Trust
from monitor.service import Monitor
from tests.test_monitor_detectors import T0, Job, update
from worker_server.state import node_name

TIMEOUT = 30.0


# nothing listens on port 1 (refused): a port picked with bind(0) and let go may be another
# test's server by the time it is asked
CLOSED_PORT = 1


@pytest.mark.e2e
def test_rank_without_a_reachable_lighthouse_is_stuck_starting(tmp_path):
    cluster = LocalCluster(tmp_path / "cluster", num_groups=1)
    log = tmp_path / "rank.log"
    proc = None
    mon = None
    try:
        cluster.start_lighthouse()  # the monitor's; the rank is given another, dead address
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "lightkeeper.cli", "train", "--replica-group", "0",
                 "--num-replica-groups", "2", "--steps", "10", "--connect-timeout", "120",
                 "--lighthouse", f"http://127.0.0.1:{CLOSED_PORT}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        url = wait_until(lambda: next((w.split("worker_server=")[1] for w in
                                       log.read_text().split() if "worker_server=" in w), None),
                         90, what="the rank's WorkerServer")
        mon = Monitor(MonitorConfig(port=0, interval_s=0.5, lighthouse=cluster.lighthouse_url,
                                    targets=[url], state_path=str(tmp_path / "m.sqlite"),
                                    detectors=DetectorConfig(starting_timeout_s=3)))
        mon.start(serve=False)
        f = wait_until(lambda: next((f for f in mon.store.findings()
                                     if f["kind"] == "stuck_starting"), None), 30,
                       what="the stuck_starting finding")
        assert (f["replica_group"], f["ranks"], f["replica_id"]) == (0, [0], None)
        rank = f["evidence"]["ranks"]["0"]
        assert rank["phase"] == "starting" and rank["verified"] is False
        assert rank["why"].startswith("no torchft Manager yet")
        assert f["evidence"]["culprit_hosts"] == [node_name()]
        assert f["confirmed_at"] - f["first_seen"] >= 3
        assert mon.store.decisions() == []  # reported only: nothing to decide
        assert proc.poll() is None  # still starting
    finally:
        if mon is not None:
            mon.stop()
        if proc is not None:
            stop_process(proc, grace=0)
        cluster.stop()


def left_out_job() -> tuple[Job, Detectors]:
    """A 3 x 2 job at step 0 of quorum 3 (group 1: ranks 2 and 3)."""
    return Job(groups=3, ranks=2), Detectors(DetectorConfig(starting_timeout_s=TIMEOUT))


def sweep(det: Detectors, job: Job, t: float, others_step: bool = True, quorum: int = 4,
          lighthouse: LighthouseStatus | None = None, **group_1) -> list:
    """The groups but 1 in ``quorum`` without it, each committing a step (``others_step``);
    group 1's ranks' states updated with ``group_1``. The stuck_starting findings newly
    confirmed at T0 + t."""
    for r, s in enumerate(job.states):
        if job.group_of(r) == 1:
            s.update(group_1)
        else:
            s.update(quorum_id=quorum, num_participants=job.n - 1, step=s["step"] + others_step,
                     last_step_at=T0 + t)
    found = update(det, job, T0 + t, lighthouse=lighthouse)
    assert det.last_error is None
    return [f for f in found if f.kind == "stuck_starting"]


# a group on its first step: none of its ranks has timed a step yet
UNTIMED = {"last_step_seconds": None, "recent_step_seconds": []}


def named(det: Detectors) -> list[tuple]:
    return [(f.replica_group, f.ranks, f.replica_id) for f in det.open_findings()
            if f.kind == "stuck_starting"]


def test_a_group_hung_on_its_first_step_the_others_went_on_without_is_stuck_starting():
    """Its old quorum's id, it answers, it never trains again: the others' process-group timeout
    ended their wait long before the hang detector's first-step hold would have."""
    job, det = left_out_job()
    for t in range(0, 30, 5):
        assert sweep(det, job, t, **UNTIMED) == []
    found = sweep(det, job, 30, **UNTIMED)
    assert [(f.replica_group, f.ranks, f.replica_id) for f in found] == [
        (1, [2, 3], "replica_group_1:sim")]
    ev = found[0].evidence
    assert ev["summary"] == ("rank(s) [2, 3] out of the job's quorums since step 0: the others "
                             "committed 6 steps in the last 30s (its quorum 3, the newest 4)")
    assert (ev["shape"], ev["step"], ev["job_steps"], ev["quorum_id"], ev["newest_quorum_id"]) \
        == ("left_out", 0, 6, 3, 4)
    assert {r: v["phase"] for r, v in ev["ranks"].items()} == {"2": "forward", "3": "forward"}
    assert ev["why"] == ("the others' quorums go on without it: a step that hung past their "
                         "process-group timeout (its first step, held as compiling?)")
    assert ev["culprit_hosts"] == ["host-g1", "host-g1"]
    assert found[0].first_seen == T0  # the monitor's clock: when it first saw it at step 0
    assert sweep(det, job, 35) == [] and named(det) == [(1, [2, 3], "replica_group_1:sim")]


def test_a_restarted_group_hung_on_its_first_step_is_judged_from_its_incarnation():
    """Named, then restarted: the old incarnation's finding closes ``replaced``; the new one is
    let into a quorum, healed to the others' step, hangs in its first forward pass and the others
    go on without it (sync quorum: it reports that quorum's id), its clock from its incarnation."""
    job, det = left_out_job()
    for t in range(0, 35, 5):
        sweep(det, job, t)
    assert named(det) == [(1, [2, 3], "replica_group_1:sim")]
    new = {"replica_id": "replica_group_1:new", "step": 7, "quorum_id": 5, "phase": "forward",
           **UNTIMED}
    for t in range(35, 65, 5):
        assert sweep(det, job, t, quorum=6, **new) == [], t
    assert named(det) == []
    f = det.resolved_findings()[-1]
    assert (f.kind, f.replica_id, f.resolution) == ("stuck_starting", "replica_group_1:sim",
                                                     "replaced")
    found = sweep(det, job, 65, quorum=6, **new)
    assert [(f.replica_group, f.ranks, f.replica_id) for f in found] == [
        (1, [2, 3], "replica_group_1:new")]
    ev = found[0].evidence
    assert ev["summary"].startswith("rank(s) [2, 3] out of the job's quorums since step 7: ")
    assert (ev["quorum_id"], ev["newest_quorum_id"]) == (5, 6)
    assert ev["why"].startswith("the others' quorums go on without it")
    assert found[0].first_seen == T0 + 35


def test_a_left_out_group_stays_named_through_a_sweep_its_ranks_do_not_answer():
    """A blip (or the monitor's own network) is no step: the finding stays open, its clock too."""
    job, det = left_out_job()
    for t in range(0, 35, 5):
        sweep(det, job, t)
    assert named(det) == [(1, [2, 3], "replica_group_1:sim")]
    job.down = set(job.members(1))
    assert sweep(det, job, 35) == []
    assert named(det) == [(1, [2, 3], "replica_group_1:sim")]
    job.down = set()
    assert sweep(det, job, 40) == []
    assert [(f.replica_group, f.first_seen) for f in det.open_findings()
            if f.kind == "stuck_starting"] == [(1, T0)]
    assert [f for f in det.resolved_findings() if f.kind == "stuck_starting"] == []


@pytest.mark.parametrize("case", ["ended", "heartbeating", "monitor_cut_off"])
def test_a_left_out_group_none_of_whose_ranks_answers_for_dead_sweeps_left_the_job(case):
    """Its ranks ended (evicted with exit, or by hand) and static targets keep them polled: the
    finding closes `left_job` once none answered for --dead-sweeps sweeps, not on one missed
    sweep; not while the Lighthouse still hears the group, nor while the monitor reaches no
    group (it may be the one cut off)."""
    job, det = left_out_job()
    hb = {f"replica_group_{g}:sim": 0.1 for g in range(3)}

    def lh(t):
        return LighthouseStatus(4, status(4, g0=t // 5, g2=t // 5).members, hb) \
            if case == "heartbeating" else None

    for t in range(0, 35, 5):
        sweep(det, job, t, lighthouse=lh(t))
    assert named(det) == [(1, [2, 3], "replica_group_1:sim")]
    job.down = set(range(6)) if case == "monitor_cut_off" else set(job.members(1))
    gone = 35 + 5 * (det.cfg.dead_sweeps - 1)  # its --dead-sweeps-th sweep unanswered
    for t in range(35, gone, 5):
        assert sweep(det, job, t, lighthouse=lh(t)) == []
        assert named(det) == [(1, [2, 3], "replica_group_1:sim")], t
    for t in range(gone, gone + 30, 5):
        sweep(det, job, t, lighthouse=lh(t))
    closed = [(f.replica_group, f.resolution) for f in det.resolved_findings()
              if f.kind == "stuck_starting"]
    if case == "ended":
        assert named(det) == [] and closed == [(1, "left_job")]
    else:
        assert named(det) == [(1, [2, 3], "replica_group_1:sim")] and closed == []


def test_a_left_out_group_is_held_only_while_every_rank_saves_under_the_checkpoint_timeout():
    job = Job(groups=3, ranks=2)
    det = Detectors(DetectorConfig(starting_timeout_s=TIMEOUT, checkpoint_timeout_s=40.0))
    for t in range(0, 40, 5):  # its save first seen at T0: held until T0 + 40
        assert sweep(det, job, t, phase="checkpoint") == [], t
    assert [f.replica_group for f in sweep(det, job, 40, phase="checkpoint")] == [1]
    assert named(det)[0][:2] == (1, [2, 3])


def test_a_left_out_group_with_one_rank_busy_and_one_in_forward_is_not_held():
    job, det = left_out_job()
    job.states[2]["phase"] = "busy"
    for t in range(0, 30, 5):
        assert sweep(det, job, t) == [], t
    found = sweep(det, job, 30)
    assert [f.replica_group for f in found] == [1]
    assert {r: v["phase"] for r, v in found[0].evidence["ranks"].items()} == {
        "2": "busy", "3": "forward"}


@pytest.mark.parametrize("phase", ["forward", "quorum"])
def test_a_group_without_a_first_quorum_in_its_forward_pass_is_not_blamed_on_the_lighthouse(
        phase):
    """Async quorum: a group hanging in its first forward pass reports quorum id -1 (it has
    asked, its first collective would wait for the answer); one in phase quorum waits for it."""
    job, det = left_out_job()
    for t in range(0, 30, 5):
        assert sweep(det, job, t, quorum_id=-1, phase=phase) == [], t
    found = sweep(det, job, 30, quorum_id=-1, phase=phase)
    assert [(f.replica_group, f.evidence["shape"]) for f in found] == [(1, "no_first_quorum")]
    whys = {v["why"] for v in found[0].evidence["ranks"].values()}
    if phase == "forward":
        assert whys == {"asked for its quorum asynchronously and has not reached its first "
                        "collective (its first step hangs, or compiles past --starting-timeout)"}
    else:
        assert whys == {"the Manager exists but no quorum was formed (Lighthouse unreachable, "
                        "or the group's other ranks never asked)"}


def test_a_rank_without_a_first_quorum_missing_a_poll_keeps_its_clock_and_finding():
    """A busy process times out a poll or two: its clock runs on and its finding stays open
    (no `started`); unreachable for --dead-sweeps sweeps and --starting-timeout (longer than a
    restart's gap), its group left the job."""
    job = Job(groups=3, ranks=1)
    det = Detectors(DetectorConfig(starting_timeout_s=TIMEOUT))
    job.states[1].update(quorum_id=-1, replica_id=None, phase="starting", step=0)

    def sweep(t, down=()):
        job.down = set(down)
        for r in (0, 2):
            job.states[r].update(quorum_id=4, num_participants=2,
                                 step=job.states[r]["step"] + 1, last_step_at=T0 + t)
        found = update(det, job, T0 + t)
        assert det.last_error is None
        return [(f.replica_group, f.first_seen) for f in found if f.kind == "stuck_starting"]

    for t in range(0, 30, 5):
        assert sweep(t, down={1} if t == 15 else ()) == [], t
    assert sweep(30) == [(1, T0)]  # its clock from T0, through the missed poll
    back = 35 + 5 * (det.cfg.dead_sweeps - 1)
    for t in range(35, back, 5):
        assert sweep(t, down={1}) == [], t
        assert named(det) == [(1, [1], None)], t
    assert sweep(back) == [] and named(det) == [(1, [1], None)]
    assert [f for f in det.resolved_findings() if f.kind == "stuck_starting"] == []
    gone = back + int(TIMEOUT)
    for t in range(back + 5, gone, 5):
        sweep(t, down={1})
        assert named(det) == [(1, [1], None)], t
    sweep(gone, down={1})
    assert named(det) == []
    assert [(f.replica_group, f.resolution) for f in det.resolved_findings()
            if f.kind == "stuck_starting"] == [(1, "left_job")]


def starting_job() -> tuple[Job, Detectors]:
    """Three groups of one rank; group 1's rank (replica id ``replica_group_1:sim``) waits for a
    first quorum the Lighthouse never forms, the others train in quorum 4."""
    job = Job(groups=3, ranks=1)
    job.states[1].update(quorum_id=-1, phase="quorum", step=0)
    return job, Detectors(DetectorConfig(starting_timeout_s=TIMEOUT))


def sweep_starting(det: Detectors, job: Job, t: float, down=(), lighthouse=None,
                   verify: bool = True, evicted=()) -> list:
    """Groups 0 and 2 commit a step; the ranks ``down`` do not answer; ``verify`` False: group
    1's rank is not verified (its answers reach only the full view); ``evicted``: replica ids
    told to go. The findings confirmed."""
    job.down = set(down)
    for r in (0, 2):
        job.states[r].update(quorum_id=4, step=job.states[r]["step"] + 1, last_step_at=T0 + t)
    view = job.view(T0 + t, judge=lambda ranks, changed: {u: Trust(
        VERIFIED, "ok", "", True) if verify or u != job.targets[1].url else Trust(
        UNVERIFIED, "unknown_replica_id", "", False) for u in changed})
    found = det.update(view.evidence(), None, T0 + t, full_view=view, lighthouse=lighthouse,
                       evicted=evicted)
    assert det.last_error is None
    return found


@pytest.mark.parametrize("case", ["monitor_cut_off", "heartbeating"])
def test_a_rank_without_a_first_quorum_unanswered_while_the_monitor_may_be_cut_off_stays_named(
        case):
    """Its rank, never verified (the finding has no replica id), stops answering for longer
    than --dead-sweeps sweeps while the monitor reaches no group, or while the Lighthouse still
    hears the replica id the rank last reported: nothing started, nothing left; back, it is the
    same finding on the same clock."""
    job, det = starting_job()
    hb = {f"replica_group_{g}:sim": 0.1 for g in range(3)}

    def lh(t):
        return LighthouseStatus(4, status(4, g0=t // 5, g2=t // 5).members, hb) \
            if case == "heartbeating" else None

    for t in range(0, 35, 5):
        sweep_starting(det, job, t, lighthouse=lh(t), verify=False)
    assert named(det) == [(1, [1], None)]
    down = {0, 1, 2} if case == "monitor_cut_off" else {1}
    for t in range(35, 35 + 5 * (det.cfg.dead_sweeps + 3), 5):
        found = sweep_starting(det, job, t, down, lh(t), verify=False)
        assert [f for f in found if f.kind == "stuck_starting"] == [], t
        assert named(det) == [(1, [1], None)], t
    back = 35 + 5 * (det.cfg.dead_sweeps + 3)
    found = sweep_starting(det, job, back, lighthouse=lh(back), verify=False)
    assert [f for f in found if f.kind == "stuck_starting"] == []
    assert [(f.replica_group, f.first_seen) for f in det.open_findings()
            if f.kind == "stuck_starting"] == [(1, T0)]
    assert [f for f in det.resolved_findings() if f.kind == "stuck_starting"] == []


@pytest.mark.parametrize("spell", ["lighthouse_unread", "monitor_cut_off"])
def test_left_job_counts_only_sweeps_in_which_every_guard_held(spell):
    """A left-out group stops answering: sweeps the Lighthouse (read before) could not be read,
    or in which the monitor reached no group, count none of --dead-sweeps and start the count
    again; it closes `left_job` on the --dead-sweeps-th sweep every guard held, not before."""
    job, det = left_out_job()
    hb = {f"replica_group_{g}:sim": 0.1 for g in range(3)}

    def lh(t, heard=hb):
        return LighthouseStatus(4, status(4, g0=t // 5, g2=t // 5).members, heard) \
            if spell == "lighthouse_unread" else None

    for t in range(0, 35, 5):
        sweep(det, job, t, lighthouse=lh(t))
    assert named(det) == [(1, [2, 3], "replica_group_1:sim")]
    for t in range(35, 60, 5):
        if spell == "lighthouse_unread":  # still heard, one read failing
            job.down = set(job.members(1))
            assert sweep(det, job, t, lighthouse=None if t == 50 else lh(t)) == [], t
        else:  # no group answers
            job.down = set(range(6))
            assert sweep(det, job, t) == [], t
        assert named(det) == [(1, [2, 3], "replica_group_1:sim")], t
    # the others answer, the Lighthouse (if read) hears group 1 no more
    job.down = set(job.members(1))
    unheard = {k: v for k, v in hb.items() if k != "replica_group_1:sim"}
    gone = 60 + 5 * (det.cfg.dead_sweeps - 1)
    for t in range(60, gone, 5):
        assert sweep(det, job, t, lighthouse=lh(t, unheard)) == [], t
        assert named(det) == [(1, [2, 3], "replica_group_1:sim")], t
    sweep(det, job, gone, lighthouse=lh(gone, unheard))
    assert named(det) == []
    assert [(f.replica_group, f.resolution, f.resolved_at) for f in det.resolved_findings()
            if f.kind == "stuck_starting"] == [(1, "left_job", T0 + gone)]


@pytest.mark.parametrize("case", ["crashed", "missed_a_poll"])
def test_a_rank_without_a_first_quorum_opens_its_finding_only_answering(case):
    """Its rank stops answering just before --starting-timeout: its last poll, carried, keeps
    its clock but opens nothing; crashed, it is `dead` alone; answering again (a busy process
    that missed a poll), its finding opens on the clock it kept."""
    job, det = starting_job()
    job.states[1].update(replica_id=None, phase="starting")
    found = []
    for t in range(0, 30, 5):
        found += sweep_starting(det, job, t, down={1} if t >= 25 else ())
    last = 35 + 5 * det.cfg.dead_sweeps
    for t in range(30, last, 5):
        new = sweep_starting(det, job, t, down={1} if case == "crashed" or t == 30 else ())
        found += [(t, f.kind, f.first_seen) for f in new]
    if case == "crashed":
        assert [k for _, k, _ in found] == ["dead"]
        assert named(det) == []
        assert [f for f in det.resolved_findings() if f.kind == "stuck_starting"] == []
    else:
        assert found == [(35, "stuck_starting", T0)]
        assert named(det) == [(1, [1], None)]


@pytest.mark.parametrize("case", ["short", "stalled", "one_step", "new_incarnation", "held"])
def test_a_group_out_of_the_quorum_is_not_named(case):
    """Out for less than the timeout; the whole job stalled (job_stall's business) or moving
    by one step only; a new incarnation (its clock afresh); a group writing a checkpoint."""
    job, det = left_out_job()
    for t in range(0, 55, 5):
        kw: dict = {}
        if case == "short":  # group 1 trained with the others until 25 s, then left out
            kw["quorum"] = 4 if t <= 25 else 5
            if t <= 25:
                kw.update(quorum_id=4, step=job.states[0]["step"] + 1)
        if case == "new_incarnation" and t >= 25:
            kw["replica_id"] = "replica_group_1:new"
        if case == "held" and t >= 25:
            kw["phase"] = "checkpoint"
        others = case not in ("stalled", "one_step") or (case == "one_step" and t == 10)
        assert sweep(det, job, t, others_step=others, **kw) == [], t
    assert named(det) == []
    if case in ("short", "new_incarnation"):  # its own timeout still names it
        assert [f.replica_group for f in sweep(det, job, 55, quorum=5)] == [1]


@pytest.mark.parametrize("how", ["steps", "takes_part"])
def test_a_left_out_group_is_named_until_it_steps_or_takes_part_again(how):
    job, det = left_out_job()
    for t in range(0, 35, 5):
        sweep(det, job, t)
    assert named(det) == [(1, [2, 3], "replica_group_1:sim")]
    # the others stall, then it writes a checkpoint: not judged, still named
    assert sweep(det, job, 40, others_step=False) == []
    assert sweep(det, job, 45, phase="checkpoint") == []
    assert named(det) == [(1, [2, 3], "replica_group_1:sim")]
    back = {"step": 1} if how == "steps" else {"quorum_id": 4, "phase": "forward"}
    assert sweep(det, job, 50, **back) == []
    assert named(det) == []
    f = det.resolved_findings()[-1]
    assert (f.kind, f.replica_group, f.resolution) == ("stuck_starting", 1, "started")


def status(quorum: int, size: int = 2, **steps: int) -> LighthouseStatus:
    """The Lighthouse's newest quorum ``quorum`` of the groups ``g<N>=step``, of ``size`` ranks
    each; every group heartbeats (a Manager does while its process lives, in a quorum or not)."""
    members = {f"replica_group_{g[1:]}:sim": QuorumMember(f"replica_group_{g[1:]}:sim", step,
                                                         "", size) for g, step in steps.items()}
    return LighthouseStatus(quorum, members, {f"replica_group_{g}:sim": 0.1 for g in range(3)})


def test_a_group_back_from_a_long_save_is_judged_from_when_the_save_ended():
    """Its step stood still through the save, which is no time out of the quorums: back at its
    old step (asking for its quorum, then healing), its clock starts when the save ended."""
    job = Job(groups=3, ranks=2)
    det = Detectors(DetectorConfig(starting_timeout_s=TIMEOUT, checkpoint_timeout_s=1800.0))
    for t in range(0, 45, 5):  # saving T0 .. T0 + 40, longer than --starting-timeout
        assert sweep(det, job, t, phase="checkpoint", phase_since=T0) == [], t
    for t in range(45, 70, 5):  # asking for its quorum at its old step
        assert sweep(det, job, t, phase="quorum", phase_since=T0 + t) == [], t
    assert named(det) == []
    found = sweep(det, job, 70, phase="quorum")  # out 30 s since the save ended
    assert [(f.replica_group, f.first_seen) for f in found] == [(1, T0 + 40)]
    assert found[0].evidence["for_s"] == 30.0


@pytest.mark.parametrize("lighthouse", [False, True])
def test_a_left_out_group_stays_named_through_a_sweep_the_others_ranks_miss(lighthouse):
    """The newest quorum id is no lower because the groups carrying it missed a poll: the left
    out group does not take part again (no `started`, no second confirmation)."""
    job = Job(groups=2, ranks=1)
    det = Detectors(DetectorConfig(starting_timeout_s=TIMEOUT))

    def lh(t):
        return status(4, size=1, g0=t // 5) if lighthouse else None

    for t in range(0, 35, 5):
        sweep(det, job, t, lighthouse=lh(t))
    assert named(det) == [(1, [1], "replica_group_1:sim")]
    job.down = {0}
    assert sweep(det, job, 35, lighthouse=lh(35)) == []
    assert named(det) == [(1, [1], "replica_group_1:sim")]
    job.down = set()
    assert sweep(det, job, 40, lighthouse=lh(40)) == []
    assert [(f.replica_group, f.first_seen) for f in det.open_findings()
            if f.kind == "stuck_starting"] == [(1, T0)]
    assert [f for f in det.resolved_findings() if f.kind == "stuck_starting"] == []
    # the others' progress over the window: no low entry from the sweep they missed
    for t in range(45, 70, 5):
        assert sweep(det, job, t, lighthouse=lh(t)) == [], t
    ev = next(f for f in det.open_findings() if f.kind == "stuck_starting").evidence
    assert ev["job_steps"] == 7  # steps 7 (T0 + 30) to 14


def test_a_left_out_group_takes_part_again_once_the_lighthouse_restarted_without_the_others():
    """A Lighthouse restart resets the ids: a lower one counts once the groups that carried the
    higher one report lower ones."""
    job, det = left_out_job()
    for t in range(0, 35, 5):
        sweep(det, job, t)
    assert named(det) == [(1, [2, 3], "replica_group_1:sim")]
    assert sweep(det, job, 40, quorum=1, quorum_id=1, phase="forward") == []
    assert named(det) == []
    f = det.resolved_findings()[-1]
    assert (f.kind, f.replica_group, f.resolution) == ("stuck_starting", 1, "started")


def test_with_the_lighthouse_status_only_its_members_take_part():
    """The group reports the newest quorum id but the Lighthouse's quorum of that id does not
    hold it (it re-asks at its old step): its ranks fail verification (``not_in_quorum``), so
    they are no evidence and nothing is named from what they claim; let into the next quorum,
    they are verified and take part."""
    job, det = left_out_job()
    for t in range(0, 35, 5):
        assert sweep(det, job, t, quorum_id=4, lighthouse=status(4, g0=t, g2=t)) == [], t
    view = job.view(T0 + 36, job.verified_by(status(4, g0=36, g2=36), T0 + 36))
    assert {rv.trust.reason for rv in view.ranks.values() if rv.replica_group == 1} == \
        {"not_in_quorum"}
    assert 1 not in view.evidence().groups
    assert named(det) == []
    # let in, healing: its ranks not yet told the new quorum
    assert sweep(det, job, 40, quorum=5, lighthouse=status(5, g0=40, g1=0, g2=40)) == []
    assert named(det) == [] and det.resolved_findings() == []
    lh = status(5, g0=41, g1=0, g2=41)
    assert 1 in job.view(T0 + 41, job.verified_by(lh, T0 + 41)).evidence().groups


def test_ranks_in_a_quorum_past_the_lighthouses_are_unverified_and_name_no_group():
    """The monitor reads the Lighthouse after the ranks, so only a restarted Lighthouse (its
    ids afresh) is behind a quorum the ranks claim: those ranks fail verification
    (``quorum_ahead``) and nothing is named from them; once it lists their quorum they take
    part again."""
    job, det = left_out_job()
    for t in range(0, 30, 5):
        assert sweep(det, job, t, lighthouse=status(4, g0=t, g2=t)) == [], t
    behind = status(4, g0=30, g2=30)
    assert sweep(det, job, 30, quorum=5, quorum_id=5, lighthouse=behind) == []
    view = job.view(T0 + 31, job.verified_by(behind, T0 + 31))
    assert {rv.trust.reason for rv in view.ranks.values()} == {"quorum_ahead"}
    assert named(det) == []
    for t in range(35, 70, 5):
        lh = status(5, g0=t, g1=t, g2=t)
        assert sweep(det, job, t, quorum=5, quorum_id=5, lighthouse=lh) == [], t
    assert named(det) == [] and det.resolved_findings() == []


def test_a_shard_without_the_newest_quorums_groups_names_a_left_out_group():
    """A --shard slice holding only the left-out group: the Lighthouse's status tells the newest
    quorum and, by its members' steps, the others' progress."""
    job, det = left_out_job()
    job.targets, job.states = job.targets[2:4], job.states[2:4]  # group 1 only
    found = []
    for t in range(0, 35, 5):
        found += update(det, job, T0 + t, lighthouse=status(4, g0=t // 5, g2=t // 5))
        assert det.last_error is None
    assert [(f.kind, f.replica_group, f.first_seen) for f in found] == [("stuck_starting", 1, T0)]
    ev = found[0].evidence
    assert (ev["shape"], ev["job_steps"], ev["quorum_id"], ev["newest_quorum_id"]) == (
        "left_out", 6, 3, 4)


def test_a_torch_only_group_out_of_the_newest_quorum_is_not_blamed_on_the_lighthouse():
    """torch's debug server: a rank out of the Lighthouse's newest quorum reports quorum id -1
    and step -1, so such a group is always the `no_first_quorum` shape."""
    job, det = left_out_job()
    polled = job.vb.update

    def torch_only(targets, polls, **kw):  # as monitor.evidence.torch_rank answers for them
        for url in job.targets[2].url, job.targets[3].url:
            polls[url].data["torch_only"] = {"store": "", "handlers": [],
                                             "flight_recorder": "none", "cannot_show": []}
        return polled(targets, polls, **kw)

    job.vb.update = torch_only
    torch = {"quorum_id": -1, "step": -1, "phase": "unknown", "participating": False}
    for t in range(0, 30, 5):
        assert sweep(det, job, t, **torch) == [], t
    found = sweep(det, job, 30, **torch)
    assert [(f.replica_group, f.evidence["shape"]) for f in found] == [(1, "no_first_quorum")]
    assert {v["why"] for v in found[0].evidence["ranks"].values()} == {
        "not in the Lighthouse's newest quorum (torch's debug server: its ranks tell no quorum "
        "of their own)"}


def test_a_group_hung_mid_run_the_others_went_on_without_is_named_for_its_hang():
    """A group that has timed steps hung at step 608 and the others formed a quorum without it
    past their process-group timeout, with no hang open for it (one named stays open:
    tests/test_hang_left_out.py; a monitor started since sees none): left_out names it, with a
    why that is no first step's."""
    job, det = left_out_job()
    for s in job.states:
        s["step"] = 608
    for t in range(0, 30, 5):
        assert sweep(det, job, t) == [], t
    found = sweep(det, job, 30)
    assert [(f.replica_group, f.evidence["shape"]) for f in found] == [(1, "left_out")]
    assert found[0].evidence["why"] == ("a step that hung past the others' process-group "
                                        "timeout: the job went on without it")


def test_a_group_is_judged_from_when_it_last_took_part_in_the_newest_quorum():
    """It waited 20 s for its first quorum, then was in the newest quorum 20 s while the others
    waited for it; they then formed one without it: left out from then, not from when the
    monitor first saw it at its step."""
    job, det = left_out_job()
    for t in range(0, 25, 5):  # no first quorum yet
        assert sweep(det, job, t, quorum_id=-1, phase="quorum") == [], t
    for t in range(25, 45, 5):  # in quorum 5 with the others, who wait for it
        assert sweep(det, job, t, others_step=False, quorum=5, quorum_id=5,
                     phase="forward") == [], t
    for t in range(45, 70, 5):  # quorum 6 goes on without it
        assert sweep(det, job, t, quorum=6) == [], t
    assert named(det) == []
    found = sweep(det, job, 70, quorum=6)  # 30 s after the last sweep it took part
    assert [(f.replica_group, f.first_seen) for f in found] == [(1, T0 + 40)]
    assert found[0].evidence["for_s"] == 30.0


@pytest.mark.parametrize("case", ["same_replica_id", "new_replica_id"])
def test_a_group_restarted_still_without_a_first_quorum_has_not_started(case):
    """Its launcher restarts its rank (a new process, still quorum -1) while it is named: the
    group has no quorum, so nothing `started` (before: it closed `started`, a new one opened a
    timeout later, a crash loop cycling so). The same finding stays open on its clock until the
    group answers with a quorum; one of a new replica id replaces it at once on that clock."""
    job, det = starting_job()
    for t in range(0, 35, 5):
        sweep_starting(det, job, t)
    assert named(det) == [(1, [1], "replica_group_1:sim")]
    rid = "replica_group_1:new" if case == "new_replica_id" else "replica_group_1:sim"
    found = []
    for t in range(35, 115, 5):  # restarted three times, the last past --starting-timeout ago
        if t in (50, 65, 80):
            job.states[1].update(pid=job.states[1]["pid"] + 1, started_at=T0 + t, replica_id=rid)
        found += [(t, f.replica_id, f.first_seen) for f in sweep_starting(det, job, t)
                  if f.kind == "stuck_starting"]
    resolved = [(f.replica_group, f.resolution) for f in det.resolved_findings()
                if f.kind == "stuck_starting"]
    if case == "new_replica_id":
        assert resolved == [(1, "replaced")] and found == [(50, rid, T0)]
    else:
        assert found == [] and resolved == []
    assert named(det) == [(1, [1], rid)]
    f = next(f for f in det.open_findings() if f.kind == "stuck_starting")
    assert (f.first_seen, f.evidence["for_s"]) == (T0, 110.0)
    job.states[1].update(quorum_id=4, phase="forward")
    sweep_starting(det, job, 115)
    assert named(det) == []
    assert [(f.replica_group, f.resolution) for f in det.resolved_findings()
            if f.kind == "stuck_starting"][-1] == (1, "started")


def test_an_unread_lighthouse_pauses_the_left_job_count():
    """--dead-sweeps 3: the named group stops answering (past --starting-timeout: no restart's
    gap) and the Lighthouse, read, stops hearing it; one read failing between pauses the count
    (before: started it again, so a /status failing once every --dead-sweeps sweeps kept it
    open for ever)."""
    job, det = starting_job()
    hb = {f"replica_group_{g}:sim": 0.1 for g in (0, 2)}

    def lh(t, heard=hb):
        return LighthouseStatus(4, status(4, g0=t // 5, g2=t // 5).members, heard)

    for t in range(0, 40, 5):
        sweep_starting(det, job, t, lighthouse=lh(t))
    assert named(det) == [(1, [1], "replica_group_1:sim")]
    assert det.cfg.dead_sweeps == 3
    for t in range(40, 70, 5):  # last answered at 35, heard until 65
        sweep_starting(det, job, t, down={1},
                       lighthouse=lh(t, {**hb, "replica_group_1:sim": 0.1}))
        assert named(det) == [(1, [1], "replica_group_1:sim")], t
    for t in (70, 75, 80):  # counted, counted, unread
        sweep_starting(det, job, t, down={1}, lighthouse=None if t == 80 else lh(t))
        assert named(det) == [(1, [1], "replica_group_1:sim")], t
    sweep_starting(det, job, 85, down={1}, lighthouse=lh(85))
    assert named(det) == []
    assert [(f.replica_group, f.resolution, f.resolved_at) for f in det.resolved_findings()
            if f.kind == "stuck_starting"] == [(1, "left_job", T0 + 85)]


def restart(job: Job, t: float, rid: str | None) -> None:
    """Group 1's rank a new process at T0 + ``t`` (``rid`` None: in its Manager's connect)."""
    s = job.states[1]
    s.update(pid=s["pid"] + 1, started_at=T0 + t, replica_id=rid,
             phase="starting" if rid is None else "quorum")


def stuck_open(det: Detectors) -> list[tuple]:
    return [(f.replica_id, f.first_seen) for f in det.open_findings()
            if f.kind == "stuck_starting"]


def test_a_group_crash_looping_without_a_quorum_stays_named_on_one_clock():
    """torchft gives each process a new replica id, and the rank is down --dead-sweeps sweeps
    between two, then answers a sweep without one (unverified, in its Manager's connect):
    each process up less than --starting-timeout, never in a quorum, the group is named
    --starting-timeout after it was first seen without one and stays named through every
    restart: one finding open at every sweep, on that clock, each replaced at once by the next
    (before: each gap closed it `left_job`, and no later process lived a timeout on its own)."""
    job, det = starting_job()
    assert det.cfg.dead_sweeps == 3
    for t in range(0, 30, 5):
        sweep_starting(det, job, t)
    for t in range(30, 200, 5):
        k, at = divmod(t - 35, 35)  # from 35 s: down 15 s, 5 s in connect, then 15 s verified
        if t >= 35 and at == 15:
            restart(job, t, None)
        elif t >= 35 and at == 20:  # the same process, its Manager up
            job.states[1].update(replica_id=f"replica_group_1:{k}", phase="quorum")
        sweep_starting(det, job, t, down={1} if t >= 35 and at < 15 else (),
                       verify=t < 35 or at >= 20)
        assert [at for _, at in stuck_open(det)] == [T0], t
    assert stuck_open(det) == [("replica_group_1:4", T0)]
    assert {f.resolution for f in det.resolved_findings() if f.kind == "stuck_starting"} == {
        "replaced"}
    job.states[1].update(quorum_id=4, phase="forward")
    sweep_starting(det, job, 200)
    assert stuck_open(det) == []
    assert det.resolved_findings()[-1].resolution == "started"


def test_an_unverified_rank_named_then_verified_still_without_a_quorum_is_one_finding():
    """Named without a replica id (in its Manager's connect, unverified), then verified with
    one, still at quorum -1: its finding is replaced by one of that replica id on the same
    clock (before: never replaced, a second one opened beside it)."""
    job, det = starting_job()
    job.states[1].update(replica_id=None, phase="starting")
    for t in range(0, 35, 5):
        sweep_starting(det, job, t, verify=False)
    assert stuck_open(det) == [(None, T0)]
    job.states[1].update(replica_id="replica_group_1:abc", phase="quorum")
    for t in range(35, 60, 5):
        sweep_starting(det, job, t)
        assert stuck_open(det) == [("replica_group_1:abc", T0)], t
    assert [(f.replica_id, f.resolution) for f in det.resolved_findings()
            if f.kind == "stuck_starting"] == [(None, "replaced")]


@pytest.mark.parametrize("how", ["quorum", "gone"])
def test_the_memory_of_no_quorum_ends_with_a_quorum_or_the_group_gone_a_timeout(how):
    """A rank of the group answering with a quorum, or none answering for --starting-timeout:
    a later process without one is judged on its own clock."""
    job, det = starting_job()
    for t in range(0, 35, 5):
        sweep_starting(det, job, t)
    assert stuck_open(det) == [("replica_group_1:sim", T0)]
    if how == "quorum":
        job.states[1].update(quorum_id=4, phase="forward")
        sweep_starting(det, job, 35)
        end = 40
    else:
        end = 40 + int(TIMEOUT)
        for t in range(35, end, 5):
            sweep_starting(det, job, t, down={1})
    assert stuck_open(det) == []
    restart(job, end, "replica_group_1:new")
    job.states[1]["quorum_id"] = -1
    for t in range(end, end + int(TIMEOUT), 5):
        sweep_starting(det, job, t)
        assert stuck_open(det) == [], t
    sweep_starting(det, job, end + int(TIMEOUT))
    assert stuck_open(det) == [("replica_group_1:new", T0 + end)]


def test_a_group_restarted_after_its_eviction_is_judged_on_a_new_clock():
    """With --evict-on stuck_starting, a group named and evicted that its launcher restarts
    within --starting-timeout (still joining: quorum -1 for seconds) is not named at first sight
    on the evicted one's clock and evicted again: the finding closes `evicted`, and so does the
    group's memory of no quorum; its ranks told to go, answering a sweep more, name nothing."""
    job = Job(groups=3, ranks=1)
    job.states[1].update(quorum_id=-1, phase="quorum", step=0)
    det = Detectors(DetectorConfig(starting_timeout_s=300))
    for t in range(0, 305, 5):
        sweep_starting(det, job, t)
    assert stuck_open(det) == [("replica_group_1:sim", T0)]  # evicted at t=300
    gone = {"replica_group_1:sim"}
    sweep_starting(det, job, 305, evicted=gone)  # told to exit, it answers once more
    assert stuck_open(det) == []
    assert [(f.replica_id, f.resolution) for f in det.resolved_findings()
            if f.kind == "stuck_starting"] == [("replica_group_1:sim", "evicted")]
    for t in range(310, 395, 5):  # exited; its pod rescheduled
        sweep_starting(det, job, t, down={1}, evicted=gone)
    restart(job, 395, "replica_group_1:new")
    for t in range(395, 695, 5):
        sweep_starting(det, job, t, evicted=gone)
        assert stuck_open(det) == [], t  # nothing named: nothing evicted
    sweep_starting(det, job, 695, evicted=gone)  # a timeout on its own: named
    assert stuck_open(det) == [("replica_group_1:new", T0 + 395)]


def test_a_rank_the_kill_did_not_reach_is_named_once_a_timeout_after_its_groups_eviction():
    """Group 1's rank 0 (rank 2) has its Manager and waits for a quorum; its rank 1 (rank 3)
    waits before its Manager (no replica id, unverified). Named and evicted, the kill ends only
    rank 2: rank 3 starts a new clock, and is named once a timeout later without the evicted
    replica id, nothing to evict (before: named again at once on the old clock under the
    evicted one, closed `evicted` and reopened every sweep, a hold decision each time)."""
    job = Job(groups=3, ranks=2)
    job.states[2].update(quorum_id=-1, phase="quorum", step=0)
    job.states[3].update(quorum_id=-1, phase="starting", step=0, replica_id=None)
    det = Detectors(DetectorConfig(starting_timeout_s=300))

    def sweep(t: float, down=(), evicted=()) -> list:
        job.down = set(down)
        for r in (0, 1, 4, 5):
            job.states[r].update(quorum_id=4, step=job.states[r]["step"] + 1, last_step_at=T0 + t)
        view = job.view(T0 + t, judge=lambda ranks, changed: {u: Trust(
            VERIFIED, "ok", "", True) if u != job.targets[3].url else Trust(
            UNVERIFIED, "unknown_replica_id", "", False) for u in changed})
        found = det.update(view.evidence(), None, T0 + t, full_view=view, evicted=evicted)
        assert det.last_error is None
        return [(f.replica_id, f.ranks, f.first_seen) for f in found if f.kind == "stuck_starting"]

    for t in range(0, 305, 5):
        sweep(t)
    assert stuck_open(det) == [("replica_group_1:sim", T0)]  # evicted at t=300
    gone = {"replica_group_1:sim"}
    for t in range(305, 605, 5):  # rank 2 exited; rank 3 answers on
        assert sweep(t, down={2}, evicted=gone) == [], t
        assert stuck_open(det) == [], t
    assert sweep(605, down={2}, evicted=gone) == [(None, [3], T0 + 305)]
    for t in range(610, 700, 5):
        assert sweep(t, down={2}, evicted=gone) == [], t
        assert stuck_open(det) == [(None, T0 + 305)], t
    assert [(f.replica_id, f.resolution) for f in det.resolved_findings()
            if f.kind == "stuck_starting"] == [("replica_group_1:sim", "evicted")]
