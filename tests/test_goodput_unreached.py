"""Groups the monitor cannot reach for a few sweeps (its polls time out under load) while they
train on: their time is pending, not capacity lost, until they answer again (their commits made
out of sight pay for it, once) or their own fault explains it. The model job of
tests/test_goodput.py, its views built as the service builds them: a real ViewBuilder fed each
sweep's polls, a rank whose poll failed kept with its last answer, unreachable."""

from __future__ import annotations

from unittest import mock

import pytest

from monitor.evidence.view import ViewBuilder
from monitor.goodput import GoodputConfig, GoodputLedger
from monitor.poll.discovery import Target
from monitor.poll.poller import RankPoll
from tests.support import goodput_reference as reference
from tests.test_goodput import ModelJob, check_counted, check_invariant
from tests.test_goodput_columns import as_rows


class PolledJob(ModelJob):
    def __init__(self, groups: int = 3) -> None:
        super().__init__(groups)
        self.builder = ViewBuilder()
        self.done: set[int] = set()  # groups whose ranks said they finished

    def ranks(self):
        out = super().ranks()
        for rv in out.values():
            if rv.state["replica_group"] in self.done:
                rv.state.update(finished=True, phase="stopped")
        return out

    def polled_view(self, at, ranks):
        polls = {url: RankPoll(url, True, data=rv.state, at=at) if rv.reachable
                 else RankPoll(url, False, reason="timeout", error="timed out", at=at)
                 for url, rv in ranks.items()}
        return self.builder.update([Target(url, "static") for url in ranks], polls, now=at)

    def sweep(self, ledger, dt: float = 1.0, pace: float = 1.0):
        # ModelJob's sweep, its view built from polls instead of from scratch
        with mock.patch("tests.test_goodput.scratch_view", self.polled_view):
            return super().sweep(ledger, dt, pace)


def causes(led: GoodputLedger) -> dict[str, float]:
    return led.to_json()["job"]["badput_seconds"]


def group(led: GoodputLedger, g: int) -> dict:
    return next(x for x in led.to_json()["groups"] if x["replica_group"] == g)


def restarted(led: GoodputLedger) -> GoodputLedger:
    """A monitor restarted from what it saved (``--state``)."""
    return GoodputLedger.restore(led.cfg, led.snapshot(),
                                 [i.to_store() for i in led.incidents.values()],
                                 [vars(iv) for iv in led.intervals])


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


def test_another_groups_fault_never_claims_time_out_of_sight():
    """Group 2 out of sight and not committing for 4 s, then back; a straggler on group 0
    confirmed later, its onset before: it claims none of group 2's time, still pending."""
    job, led = PolledJob(), GoodputLedger()
    job.run(led, 20)
    onset = job.t
    job.groups[2].update(reach=False, **{"in": False})
    job.run(led, 4)
    job.groups[2].update(reach=True, **{"in": True})
    job.run(led, 2)
    job.finding("straggler", 0, first_seen=onset, confirmed_at=job.t, fid=9)
    job.run(led, 2)
    g2 = group(led, 2)
    assert g2["badput_seconds"].get("straggler_drag", 0) == 0
    assert g2["badput_seconds"].get("capacity_lost", 0) == 0
    assert g2["pending_seconds"] == pytest.approx(4, abs=0.01)
    check_counted(job, led)


def test_a_group_that_said_it_stopped_is_not_out_of_sight():
    """Group 2's ranks said they finished, then went away: out of the job, not out of sight,
    so its slot is capacity lost as before, never pending then unattributed."""
    job, led = PolledJob(), GoodputLedger(GoodputConfig(horizon_s=10.0))
    job.run(led, 20)
    job.done = {2}
    job.groups[2].update(**{"in": False})
    job.sweep(led)  # its ranks answer once: stopped
    job.groups[2].update(reach=False)
    job.run(led, 20)
    b = causes(led)
    assert b["unattributed"] == 0 and led.to_json()["job"]["pending_seconds"] == 0
    assert group(led, 2)["badput_seconds"]["capacity_lost"] == pytest.approx(21, abs=0.01)
    check_counted(job, led)


def test_its_own_straggler_confirmed_out_of_sight_leaves_its_commits_goodput():
    job, led = PolledJob(), GoodputLedger()
    job.run(led, 20)
    good0 = group(led, 2)["goodput_seconds"]
    onset = job.t
    job.groups[2].update(reach=False)  # still in the quorum, committing at pace
    job.run(led, 4)
    job.finding("straggler", 2, first_seen=onset, confirmed_at=job.t, fid=9)
    job.run(led, 1)
    job.groups[2].update(reach=True)
    job.run(led, 3)
    assert causes(led)["capacity_lost"] == 0
    g2 = group(led, 2)
    assert g2["goodput_seconds"] - good0 == pytest.approx(8, abs=0.01)
    assert g2["pending_seconds"] == pytest.approx(0, abs=0.01)
    check_counted(job, led)


@pytest.mark.parametrize("restart", [False, True])
def test_a_restart_out_of_sight_keeps_the_time_for_its_commits(restart):
    job, led = PolledJob(), GoodputLedger()
    job.run(led, 20)
    good0 = led.to_json()["job"]["goodput_seconds"]
    job.groups[2].update(reach=False)  # committing on, out of sight
    job.run(led, 3)
    if restart:
        led = restarted(led)
    job.run(led, 2)
    job.groups[2].update(reach=True)
    job.run(led, 3)
    out = led.to_json()
    check_invariant(led)
    assert causes(led)["capacity_lost"] == 0 and out["job"]["pending_seconds"] == 0
    assert out["job"]["goodput_seconds"] - good0 == pytest.approx(3 * 8, abs=0.01)


def test_commits_made_out_of_sight_pay_for_time_once():
    """Group 2's commits made out of sight paid for that time when it answered; when the whole
    job then stalls, they do not keep its pace up too: it earns no more than the others."""
    job, led = PolledJob(), GoodputLedger()
    job.run(led, 30)
    job.groups[2].update(reach=False)
    job.run(led, 4)
    job.groups[2].update(reach=True)
    job.sweep(led)
    assert led.to_json()["job"]["pending_seconds"] == pytest.approx(0, abs=0.01)
    before = {g: group(led, g)["goodput_seconds"] for g in (0, 2)}
    job.run(led, 3, pace=0.0)  # the whole job stalls
    gained = {g: group(led, g)["goodput_seconds"] - before[g] for g in (0, 2)}
    assert gained[2] == pytest.approx(gained[0], abs=0.01)
    check_counted(job, led)


class Both:
    """The columnar ledger and the per-group reference (tests/support/goodput_reference.py)
    fed the same sweeps, checked equal after each; read as the columnar one."""

    def __init__(self) -> None:
        self.new, self.ref = GoodputLedger(), reference.GoodputLedger()

    def update(self, view, findings, evictions, now):
        a = self.new.update(view, [dict(f) for f in findings], [dict(d) for d in evictions], now)
        b = self.ref.update(view, [dict(f) for f in findings], [dict(d) for d in evictions], now)
        assert vars(a) == vars(b)
        assert self.new.to_json() == self.ref.to_json()
        assert as_rows(self.new) == as_rows(self.ref)
        return a

    def __getattr__(self, name):
        return getattr(self.new, name)


def test_time_out_of_sight_as_the_per_group_ledger():
    job, both = PolledJob(), Both()
    job.run(both, 20)
    for g in (0, 2):  # out of sight, committing: paid back in full
        job.groups[g]["reach"] = False
    job.run(both, 4)
    for g in (0, 2):
        job.groups[g]["reach"] = True
    job.run(both, 3)
    onset = job.t
    job.groups[2].update(reach=False, **{"in": False})  # 2 s idle, 2 s committing, unseen
    job.run(both, 2)
    job.groups[2]["in"] = True
    job.run(both, 2)
    job.finding("straggler", 2, first_seen=onset, confirmed_at=job.t, fid=3)
    job.run(both, 1)
    job.groups[2]["reach"] = True  # what its commits did not pay is its straggler's drag
    job.run(both, 2)
    drag = causes(both)["straggler_drag"]
    assert drag > 0
    onset = job.t
    job.groups[0].update(reach=False, **{"in": False})
    job.run(both, 2)
    job.groups[0].update(reach=True, **{"in": True})
    job.run(both, 2)
    assert both.to_json()["job"]["pending_seconds"] > 0  # what its commits did not pay
    job.finding("straggler", 0, first_seen=onset, confirmed_at=job.t, fid=5)
    job.run(both, 2)
    assert causes(both)["straggler_drag"] > drag
    dark = job.t
    job.groups[1].update(reach=False, **{"in": False})
    job.run(both, 2)
    job.finding("dead", 1, first_seen=dark, confirmed_at=job.t, fid=4)
    job.run(both, 3)
    assert causes(both)["capacity_lost"] == pytest.approx(5, abs=0.01)


def test_a_survivor_out_of_sight_during_a_recovery_is_paid_by_its_commits():
    """Group 1 hangs and is evicted; while the survivors recover, group 2's polls time out
    though it trains on: its time is its commits' goodput when it answers, no recovery."""
    job, led = PolledJob(), GoodputLedger()
    job.run(led, 20)
    job.finding("hang", 1, first_seen=job.t - 1, confirmed_at=job.t, fid=1)
    job.evict(1, at=job.t, did=1, fid=1)
    job.evictions[-1]["status"] = "confirmed"
    job.groups[2]["reach"] = False
    job.run(led, 3)
    assert led.to_json()["incidents"][0]["back_to_pace"] is None  # still recovering
    job.groups[2]["reach"] = True
    job.run(led, 2)
    g2 = group(led, 2)
    assert g2["badput_seconds"].get("recovery", 0) == 0 and g2["pending_seconds"] == 0
    check_counted(job, led)
