"""Groups the monitor cannot reach for a few sweeps (its polls time out under load), and a job
whose fault strikes before its baseline has formed. The model job of tests/test_goodput.py, its
views built as the service builds them: a real ViewBuilder fed each sweep's polls, a rank whose
poll failed kept with its last answer, unreachable."""

from __future__ import annotations

import pytest

from monitor.evidence.view import ViewBuilder
from monitor.goodput import GoodputConfig, GoodputLedger
from monitor.poll.discovery import Target
from monitor.poll.poller import RankPoll
from tests.test_goodput import STEP, ModelJob, check_counted, check_invariant


class PolledJob(ModelJob):
    def __init__(self, groups: int = 3) -> None:
        super().__init__(groups)
        self.builder = ViewBuilder()

    def view(self):
        ranks = self.ranks()
        polls = {url: RankPoll(url, True, data=rv.state, at=self.t) if rv.reachable
                 else RankPoll(url, False, reason="timeout", error="timed out", at=self.t)
                 for url, rv in ranks.items()}
        return self.builder.update([Target(url, "static") for url in ranks], polls, now=self.t)


def causes(led: GoodputLedger) -> dict[str, float]:
    return led.to_json()["job"]["badput_seconds"]


def test_groups_out_of_sight_but_committing_lose_no_capacity():
    job, led = PolledJob(), GoodputLedger()
    job.run(led, 20)
    good0 = led.to_json()["job"]["goodput_seconds"]
    for g in (0, 2):  # their polls time out; they go on training with group 1
        job.groups[g]["reach"] = False
    job.run(led, 4)
    out = led.to_json()
    assert out["job"]["badput_seconds"]["capacity_lost"] == 0
    assert out["job"]["pending_seconds"] == pytest.approx(2 * 4, abs=0.01)
    for g in (0, 2):
        job.groups[g]["reach"] = True
    job.run(led, 3)
    out = led.to_json()
    # their commits made out of sight, credited when they answered again
    assert out["job"]["goodput_seconds"] - good0 == pytest.approx(3 * 7, abs=0.01)
    assert out["job"]["pending_seconds"] == pytest.approx(0, abs=0.01)
    assert {c: v for c, v in causes(led).items() if v and c != "startup"} == {}
    assert not [iv for iv in out["intervals"] if iv["cause"] == "capacity_lost"]
    check_counted(job, led)


def test_a_group_gone_dark_waits_for_its_own_incident():
    """Out of sight and not committing: pending, not capacity lost on nothing; the dead
    finding that follows claims it back to its onset as its capacity lost."""
    job, led = PolledJob(), GoodputLedger()
    job.run(led, 20)
    dark = job.t
    job.groups[2].update(reach=False, **{"in": False})  # its processes are gone
    job.run(led, 3)
    assert causes(led)["capacity_lost"] == 0
    assert led.to_json()["job"]["pending_seconds"] == pytest.approx(3, abs=0.01)
    job.finding("dead", 2, first_seen=dark, confirmed_at=job.t, fid=4)
    job.run(led, 5)
    out = led.to_json()
    [inc] = out["incidents"]
    assert inc["cost"]["by_cause"] == {"capacity_lost": pytest.approx(8, abs=0.01)}
    assert out["job"]["pending_seconds"] == pytest.approx(0, abs=0.01)
    check_invariant(led)
    check_counted(job, led)


def test_a_group_gone_dark_with_nothing_found_settles_unattributed():
    job, led = PolledJob(), GoodputLedger(GoodputConfig(horizon_s=10.0))
    job.run(led, 20)
    job.groups[2].update(reach=False, **{"in": False})
    job.run(led, 15)
    b = causes(led)
    assert b["capacity_lost"] == 0
    assert b["unattributed"] == pytest.approx(15 - 10, abs=1.01)  # older than the horizon
    check_counted(job, led)


def test_a_fault_before_the_baseline_forms_stays_out_of_it():
    """No warm-up: group 1 hangs 5 s into the job, the others stall with it until it is
    evicted; it never returns, so its incident stays open. The baseline is the survivors'
    step time, not one stretched by the stall, and a later slowdown is not goodput."""
    job, led = PolledJob(), GoodputLedger()
    job.run(led, 5)
    onset = job.t
    job.run(led, 3, pace=0.0)
    job.finding("hang", 1, first_seen=onset, confirmed_at=job.t, fid=1)
    job.sweep(led, pace=0.0)
    job.evict(1, at=job.t, did=1, fid=1)
    job.evictions[-1]["status"] = "confirmed"
    job.run(led, 2, pace=0.0)  # the survivors wait for the quorum to drop it
    job.run(led, 40)
    out = led.to_json()
    [inc] = out["incidents"]
    assert inc["open"] and inc["replica_group"] == 1
    assert out["baseline"]["step_seconds"] == pytest.approx(STEP, rel=0.05)
    assert out["pace"]["ratio"] == pytest.approx(1.0, abs=0.1)
    good0 = out["job"]["goodput_seconds"]
    job.run(led, 10, pace=0.7)  # the survivors slow down: 2 groups at 0.7x for 10 s
    gained = led.to_json()["job"]["goodput_seconds"] - good0
    assert gained == pytest.approx(2 * 10 * 0.7, abs=2 * 2 * STEP)
    check_counted(job, led)


def test_a_young_baseline_held_by_a_fault_never_acted_on_follows_after_the_horizon():
    """A straggler found before the baseline formed, held (never evicted, never cleared): the
    samples since its onset stay out only for the horizon, then startup ends."""
    job, led = PolledJob(), GoodputLedger(GoodputConfig(horizon_s=20.0))
    job.run(led, 5)
    job.finding("straggler", 1, first_seen=job.t, confirmed_at=job.t + 1, fid=1)
    job.run(led, 12, pace=0.5)
    assert led.to_json()["baseline"]["step_seconds"] is None
    job.run(led, 20, pace=0.5)
    assert led.to_json()["baseline"]["step_seconds"] == pytest.approx(STEP / 0.5, rel=0.05)
    check_invariant(led)
