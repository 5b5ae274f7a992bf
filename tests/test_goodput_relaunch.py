"""A job relaunched whole from its checkpoint (every replica group a new incarnation, the
quorum's step back where the checkpoint was): the job started over, however few steps back, so
its return to pace is dated from the relaunch, not from when it passes its old step again. The
model job of tests/test_goodput.py."""

from __future__ import annotations

from monitor.goodput import GoodputConfig, GoodputLedger
from monitor.goodput.pace import JobPace
from tests.test_goodput import T0, ModelJob


def relaunched(steps_back: int) -> dict:
    """A hang in group 2, evicted; then the whole job relaunched ``steps_back`` steps back."""
    job, led = ModelJob(3), GoodputLedger()
    job.run(led, 40)
    job.finding("hang", 2, first_seen=job.t, confirmed_at=job.t + 1, fid=1)
    job.run(led, 2, pace=0.0)
    job.evict(2, at=job.t, did=1, fid=1)
    job.evictions[-1]["status"] = "confirmed"
    job.findings = []
    job.run(led, 2, pace=0.0)
    job.progress -= steps_back
    for g in range(3):
        job.restart(g, "relaunched")
        job.groups[g]["joined"] = job.progress
    job.run(led, 30)
    [inc] = led.to_json()["incidents"]
    return inc


def test_recovery_after_a_relaunch_does_not_depend_on_how_far_back_its_checkpoint_was():
    far = relaunched(300)  # beyond JOB_RESTART_STEPS: a restart by its size alone
    assert far["recovery_s"] is not None and not far["open"]
    for steps_back in (10, 60, 99):  # each more than a sweep commits
        inc = relaunched(steps_back)
        assert (inc["recovery_s"], inc["back_to_pace_at"]) == (
            far["recovery_s"], far["back_to_pace_at"]), steps_back


def paced_to(step: int, rids: list[str | None]) -> tuple[JobPace, float]:
    """A job's pace that reached ``step`` with ``rids`` in the quorum, a step a second."""
    job, t = JobPace(GoodputConfig()), T0
    for s in range(step - 30, step + 1):
        t += 1.0
        job.ingest([s] * len(rids), t, rids=rids, seen=rids)
    return job, t


def test_a_new_incarnation_alone_in_the_quorum_for_a_sweep_is_no_relaunch():
    """Group 2 restarted, 4 steps behind, is for one sweep the only group counted in the
    quorum (the others' answers late at the quorum change): groups 0 and 1 still report the
    incarnations the job reached step 1039 with, so the job's history stands."""
    old = ["g0:a", "g1:a", "g2:a"]
    job, t = paced_to(1039, old)
    kept = list(job.history)
    job.ingest([1035], t + 1, rids=["g2:b"], seen=["g0:a", "g1:a", "g2:b"])
    assert job.step == 1039 and list(job.history)[:len(kept)] == kept
    # every group a new incarnation, none of the old left: relaunched, history started over
    job.ingest([1035] * 3, t + 2, rids=["g0:b", "g1:b", "g2:b"],
               seen=["g0:b", "g1:b", "g2:b"])
    assert job.step == 1035 and list(job.history) == [(t + 2, 1035)]


def test_a_quorum_of_no_known_incarnation_makes_no_drop_a_relaunch():
    job, t = paced_to(1039, [None, None])
    kept = list(job.history)
    job.ingest([1035], t + 1, rids=["g0:b"], seen=["g0:b", None])
    assert job.step == 1039 and list(job.history)[:len(kept)] == kept
