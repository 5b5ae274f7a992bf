"""A crash in the middle of a step (a rank of group 0 gone, its ``dead`` finding never evicted by
default): torchft's survivors fail that step and commit nothing until a new quorum forms
without it. That commit-less time from the crash's onset is the crash's ``stall``; once they
commit again, a later stall is not the dead group's. Driven through tests/test_goodput.py's
model job."""

from __future__ import annotations

import pytest

from tests.test_goodput import check_counted, check_invariant, healthy_ledger


def _crashed(stalled: int):
    """Group 0 gone at ``crash``, found ``dead`` a sweep later; the survivors stand still for
    ``stalled`` sweeps, then go on at pace without it."""
    job, led = healthy_ledger(groups=3, seconds=30, horizon_s=10.0)
    crash = job.t
    job.groups[0].update({"in": False, "reach": False})
    job.sweep(led, pace=0.0)
    job.finding("dead", 0, first_seen=crash + 0.1, confirmed_at=job.t, fid=1)
    job.run(led, stalled - 1, pace=0.0)
    job.run(led, 20)
    return job, led, crash


@pytest.mark.parametrize("stalled", [3, 8])  # within a pace window W (4 s), and longer
def test_the_survivors_stall_after_a_crash_is_its_cost(stalled):
    job, led, crash = _crashed(stalled)
    doc = led.to_json()
    [inc] = doc["incidents"]
    assert inc["kind"] == "dead" and inc["open"]
    # the two survivors' commit-less seconds, and group 0's capacity from the crash on
    assert inc["cost"]["by_cause"]["stall"] == pytest.approx(2 * stalled)
    assert inc["cost"]["by_cause"]["capacity_lost"] == pytest.approx(job.t - crash)
    bad = doc["job"]["badput_seconds"]
    assert bad["stall"] == pytest.approx(2 * stalled)
    assert bad["unattributed"] == 0 and doc["job"]["pending_seconds"] == 0
    check_invariant(led)
    check_counted(job, led)


def test_a_dead_group_the_job_went_on_without_takes_no_later_stall():
    """Once the survivors committed after the crash, a later pause nothing explains is not the
    dead group's: it settles ``unattributed``, or ``stall`` on no incident."""
    job, led, _ = _crashed(3)
    before = led.to_json()["incidents"][0]["cost"]["by_cause"]["stall"]
    job.run(led, 8, pace=0.0)
    job.run(led, 20)
    doc = led.to_json()
    [inc] = doc["incidents"]
    assert inc["cost"]["by_cause"]["stall"] == before
    bad = doc["job"]["badput_seconds"]
    assert bad["stall"] + bad["unattributed"] == pytest.approx(before + 2 * 8)
    check_invariant(led)
    check_counted(job, led)
