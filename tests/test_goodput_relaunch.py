"""A job relaunched whole from its checkpoint (every replica group a new incarnation, the
quorum's step back where the checkpoint was): the job started over, however few steps back, so
its return to pace is dated from the relaunch, not from when it passes its old step again. The
model job of tests/test_goodput.py."""

from __future__ import annotations

from monitor.goodput import GoodputLedger
from tests.test_goodput import ModelJob


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
