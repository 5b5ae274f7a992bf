"""A job with no rank running after a kill the monitor sent (one group, or every group, down):
the time until the killed group's relaunch answers is capacity lost on the kill's incident, up
to a bound, not unobserved. The model job of tests/test_goodput.py."""

from __future__ import annotations

import pytest

from monitor.goodput.ledger import RELAUNCH_S
from tests.test_goodput import check_counted, check_invariant, healthy_ledger


def _killed(groups: int = 1):
    """A hang in the last group, confirmed and killed: its ranks stop answering."""
    job, led = healthy_ledger(groups=groups, seconds=40)
    g = groups - 1
    h = job.t
    job.run(led, 3, pace=0.0)
    job.finding("hang", g, first_seen=h + 0.1, confirmed_at=job.t, fid=7)
    job.evict(g, at=job.t, did=1, fid=7)
    job.evictions[-1]["status"] = "confirmed"
    job.groups[g]["reach"] = False
    return job, led


def test_a_one_group_job_down_after_its_kill_loses_capacity_on_the_incident():
    job, led = _killed()
    job.run(led, 60, pace=0.0)  # 60 s to relaunch
    job.findings.clear()
    job.restart(0, "b")
    job.groups[0]["reach"] = True
    job.run(led, 30, pace=1.0)
    out = led.to_json()
    [inc] = out["incidents"]
    assert out["unobserved_seconds"] == 0
    assert inc["cost"]["by_cause"]["capacity_lost"] == pytest.approx(60, abs=0.01)
    assert out["job"]["badput_seconds"]["capacity_lost"] == pytest.approx(60, abs=0.01)
    assert inc["rejoined_at"] is not None
    check_invariant(led)
    check_counted(job, led)


def test_every_group_down_after_a_kill_loses_every_slot():
    job, led = _killed(groups=2)
    job.groups[0]["reach"] = False  # the survivor crashes too
    job.run(led, 10, pace=0.0)
    out = led.to_json()
    [inc] = out["incidents"]
    assert out["unobserved_seconds"] == 0
    assert inc["cost"]["by_cause"]["capacity_lost"] == pytest.approx(2 * 10, abs=0.01)


def test_a_job_still_down_past_the_bound_stops_losing_capacity():
    job, led = _killed()
    killed_at = job.t
    job.run(led, RELAUNCH_S + 95, pace=0.0, dt=10.0)  # never relaunched: the job ended
    out = led.to_json()
    [inc] = out["incidents"]
    lost = inc["cost"]["by_cause"]["capacity_lost"]
    assert lost == pytest.approx(RELAUNCH_S, abs=0.01)
    assert out["unobserved_seconds"] == pytest.approx(job.t - killed_at - RELAUNCH_S, abs=0.01)
    job.run(led, 100, pace=0.0, dt=10.0)
    assert led.to_json()["incidents"][0]["cost"]["by_cause"]["capacity_lost"] == lost
    check_invariant(led)


def test_a_job_whose_other_ranks_stopped_after_a_kill_ended():
    """The survivor's ranks say ``stopped``: training finished, nothing is lost after it."""
    job, led = _killed(groups=2)
    job.groups[0]["phase"] = "stopped"
    job.run(led, 10, pace=0.0)
    out = led.to_json()
    assert out["unobserved_seconds"] == pytest.approx(10, abs=0.01)
    [inc] = out["incidents"]
    assert "capacity_lost" not in inc["cost"]["by_cause"]


def test_a_job_that_went_on_after_the_kill_then_vanished_ended():
    """The survivor committed after the kill, then no rank answers: the job ended (or cannot
    be reached), not down for the kill."""
    job, led = _killed(groups=2)
    job.run(led, 5, pace=1.0)
    job.groups[0]["reach"] = False
    job.run(led, 10, pace=0.0)
    out = led.to_json()
    assert out["unobserved_seconds"] == pytest.approx(10, abs=0.01)
    [inc] = out["incidents"]
    assert inc["cost"]["by_cause"]["capacity_lost"] == pytest.approx(5, abs=0.01)


def test_steps_made_before_the_kill_landed_are_not_the_job_going_on():
    """The kill is decided after the sweep's view; the next view still has the killed
    straggler in the quorum, committing (before the kill landed). Then the kill takes the
    whole job down: that is down for the kill, not a job that went on and ended."""
    job, led = healthy_ledger(groups=3, seconds=40)
    job.finding("straggler", 2, first_seen=job.t - 5, confirmed_at=job.t, fid=7)
    job.evict(2, at=job.t + 0.05, did=1, fid=7)
    job.evictions[-1]["status"] = "confirmed"
    job.groups[2]["in"] = True  # the kill has not landed yet
    job.sweep(led, pace=0.4)
    for g in job.groups.values():
        g["in"] = g["reach"] = False
    job.run(led, 60, pace=0.0)
    out = led.to_json()
    [inc] = out["incidents"]
    assert out["unobserved_seconds"] == 0
    assert inc["cost"]["by_cause"]["capacity_lost"] == pytest.approx(3 * 60, abs=0.01)
    check_invariant(led)
    check_counted(job, led)


def test_down_for_a_kill_charges_it_only_the_groups_that_ran():
    """--expected-groups 4, two groups ever seen: down for the kill, the two slots never seen
    lose capacity on no incident (as while running), the two groups that ran on the kill's."""
    job, led = healthy_ledger(groups=2, seconds=40, expected_groups=4)
    h = job.t
    job.run(led, 3, pace=0.0)
    job.finding("hang", 1, first_seen=h + 0.1, confirmed_at=job.t, fid=7)
    job.evict(1, at=job.t, did=1, fid=7)
    job.evictions[-1]["status"] = "confirmed"
    down_at = job.t
    for g in job.groups.values():
        g["reach"] = False  # the survivor goes down too
    job.run(led, 60, pace=0.0)
    out = led.to_json()
    [inc] = out["incidents"]
    assert out["unobserved_seconds"] == 0
    assert inc["cost"]["by_cause"]["capacity_lost"] == pytest.approx(2 * 60, abs=0.01)
    unseen = [iv for iv in out["intervals"] if iv["replica_group"] is None
              and iv["end"] > down_at + 1e-6]
    assert unseen and all(iv["cause"] == "capacity_lost" and iv["incident"] is None
                          for iv in unseen), unseen
    check_invariant(led)
    check_counted(job, led)


def test_down_for_a_kill_a_group_never_in_the_quorum_is_still_starting():
    """A group seen but never yet in the quorum, nothing found about it, when the kill took
    the job down: its time is startup, as while running, not the kill's."""
    job, led = healthy_ledger(groups=2, seconds=40)
    job.groups[2] = {**job.groups[0], "rid": "replica_group_2:a", "commits": 0, "in": False,
                     "struck": {}}
    job.run(led, 2, pace=1.0)
    h = job.t
    job.run(led, 3, pace=0.0)
    job.finding("hang", 1, first_seen=h + 0.1, confirmed_at=job.t, fid=7)
    job.evict(1, at=job.t, did=1, fid=7)
    job.evictions[-1]["status"] = "confirmed"
    for g in job.groups.values():
        g["reach"] = False
    job.run(led, 10, pace=0.0)
    out = led.to_json()
    [inc] = out["incidents"]
    assert inc["cost"]["by_cause"]["capacity_lost"] == pytest.approx(2 * 10, abs=0.01)
    g2 = next(g for g in out["groups"] if g["replica_group"] == 2)
    assert g2["badput_seconds"]["capacity_lost"] == 0
    assert g2["badput_seconds"]["startup"] >= 10
    check_invariant(led)
