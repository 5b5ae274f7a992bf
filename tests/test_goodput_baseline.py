"""The healthy baseline against faults (docs/goodput.md, "healthy baseline `b`"): a fault found
while the baseline is young does not stay in it, and an incident whose group never returns
(evicted, or found dead) holds it only until the job is back at pace.

The job is tests/test_goodput.py's model (steps of ``STEP`` seconds at pace 1.0), one sweep a
second."""

from __future__ import annotations

import pytest

from tests.test_goodput import STEP, healthy_ledger


def slowdown_after(evicted: bool, dead: bool = False) -> tuple[dict, float]:
    """60 s healthy, group 0 killed by hand (or found ``dead``, never evicted by default, or
    neither) and never back, 30 s at pace, then the job's own pace falls to 0.8x for good (a
    new data phase, say): the ledger's document and the unattributed replica-seconds of that
    last phase."""
    job, led = healthy_ledger(seconds=60, horizon_s=10.0)
    if evicted:
        job.evict(0, at=job.t + 0.5, did=3, source="manual")
        job.evictions[-1]["status"] = "confirmed"
    if dead:
        job.groups[0].update({"in": False, "reach": False})
        job.finding("dead", 0, first_seen=job.t, confirmed_at=job.t + 3, fid=5)
    job.run(led, 30)
    before = led.to_json()["job"]["badput_seconds"]["unattributed"]
    job.run(led, 120, pace=0.8)
    out = led.to_json()
    return out, out["job"]["badput_seconds"]["unattributed"] - before


def test_a_group_that_never_returns_does_not_freeze_the_baseline_for_good():
    alone, lost_alone = slowdown_after(evicted=False)
    out, lost = slowdown_after(evicted=True)
    [inc] = out["incidents"]
    assert inc["open"] and inc["back_to_pace"] == "reached" and inc["rejoined_at"] is None
    # still losing its group's capacity: the whole time since the kill
    assert inc["cost"]["by_cause"]["capacity_lost"] == pytest.approx(150, abs=1.01)
    # the lasting change of pace is adopted after the horizon, as without the kill: the same
    # unattributed time on the two groups left as on each of the three
    assert alone["baseline"]["step_seconds"] == pytest.approx(STEP / 0.8, rel=0.02)
    assert out["baseline"]["step_seconds"] == pytest.approx(STEP / 0.8, rel=0.02)
    assert out["baseline"]["frozen"] is None and out["job"]["pending_seconds"] == 0
    assert 0 < lost == pytest.approx(lost_alone * 2 / 3, rel=0.05)


def test_a_dead_group_never_acted_on_does_not_freeze_the_baseline_for_good():
    """Its finding stays open (the group never returns, nothing evicts it): the group is out of
    the quorum, its cost capacity, not the job's pace, as an evicted one's."""
    _, lost_evicted = slowdown_after(evicted=True)
    out, lost = slowdown_after(evicted=False, dead=True)
    [inc] = out["incidents"]
    assert inc["kind"] == "dead" and inc["open"] and inc["back_to_pace"] == "reached"
    assert inc["evicted_at"] is None and inc["cost"]["by_cause"]["capacity_lost"] > 0
    assert out["baseline"]["step_seconds"] == pytest.approx(STEP / 0.8, rel=0.02)
    assert out["baseline"]["frozen"] is None and out["job"]["pending_seconds"] == 0
    assert lost == pytest.approx(lost_evicted, rel=0.05)


def straggler(warm: float) -> tuple[dict, dict, dict]:
    """After ``warm`` s, group 1 at half pace for 20 s until its straggler is confirmed, then
    evicted and back as a new incarnation; then the job at half pace again (no finding). The
    document at the onset, at the confirmation sweep, and at the end."""
    job, led = healthy_ledger(seconds=warm)
    at_onset = led.to_json()
    onset = job.t
    job.groups[1]["struck"] = {"slow": onset + 0.1}
    job.run(led, 20, pace=0.5)
    job.finding("straggler", 1, first_seen=onset + 0.1, confirmed_at=job.t, fid=11)
    job.sweep(led, pace=0.5)
    confirmed = led.to_json()
    job.evict(1, at=job.t, did=5, fid=11)
    job.evictions[-1]["status"] = "confirmed"
    job.run(led, 3, pace=0.0)
    job.restart(1, "b")
    job.run(led, 40)
    job.run(led, 5, pace=0.5)
    return at_onset, confirmed, led.to_json()


def test_a_fault_found_while_the_baseline_is_young_does_not_stay_in_it():
    # 14 s: the baseline has 11 samples (startup's 10 and one), young; 60 s: 57, mature
    at_onset, young_at_confirm, young = straggler(14)
    _, mature_at_confirm, mature = straggler(60)
    assert 10 <= at_onset["baseline"]["samples"] < at_onset["baseline"]["window_samples"] // 4
    # the samples the slow job gave the young baseline go when the fault is found
    for doc in (young_at_confirm, mature_at_confirm, young, mature):
        assert doc["baseline"]["step_seconds"] == pytest.approx(STEP, rel=0.02)
    [inc] = young["incidents"]
    [ref] = mature["incidents"]
    assert not inc["open"] and inc["back_to_pace"] == "reached"
    # the job later at half pace reads so, not "at pace" against a doubled step
    assert young["pace"]["ratio"] == pytest.approx(0.5, abs=0.05)
    # its drag is judged again with the baseline from before the onset; the sweeps judged before
    # the confirmation against the baseline the fault had moved keep that judgement (Limits)
    drag = inc["cost"]["by_cause"]["straggler_drag"]
    assert drag == pytest.approx(ref["cost"]["by_cause"]["straggler_drag"], rel=0.25)


def test_a_fault_before_the_baseline_formed_leaves_it_formed():
    """Too few samples from before the onset to make a baseline: it keeps the ones it has (it
    does not start over: the incident's time is its cost, not startup)."""
    job, led = healthy_ledger(seconds=8)
    assert led.to_json()["baseline"]["step_seconds"] is None
    onset = job.t
    job.run(led, 10, pace=0.5)
    job.finding("straggler", 1, first_seen=onset, confirmed_at=job.t, fid=11)
    job.sweep(led, pace=0.5)
    out = led.to_json()
    assert out["baseline"]["step_seconds"] is not None
    startup = out["job"]["badput_seconds"]["startup"]
    job.run(led, 5, pace=0.5)
    out = led.to_json()
    assert out["job"]["badput_seconds"]["startup"] == startup
    [inc] = out["incidents"]
    assert inc["cost"]["by_cause"]["straggler_drag"] > 0


def test_a_dead_group_whose_absence_slows_the_job_holds_the_baseline_only_for_the_horizon():
    """Group 0 found ``dead`` (never evicted by default) and from then on the job runs at 0.8x
    for good, never back at pace: a capacity-only incident holds the baseline no longer than
    the horizon after its detection, so the job's new pace is adopted."""
    from tests.test_goodput_held import compared_ledger
    job, led = compared_ledger(seconds=60, horizon_s=10.0)
    job.groups[0].update({"in": False, "reach": False})
    job.finding("dead", 0, first_seen=job.t, confirmed_at=job.t + 3, fid=5)
    job.run(led, 300, pace=0.8)
    out = led.to_json()
    assert out["baseline"]["frozen"] is None, out["baseline"]
    assert out["baseline"]["step_seconds"] == pytest.approx(STEP / 0.8, rel=0.02)
    assert out["pace"]["ratio"] >= 0.9
