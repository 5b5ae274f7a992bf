"""A fault before the baseline has matured (fewer than a quarter of its samples, "young"): the
samples its sweeps gave before it was confirmed never enter the baseline, and an incident whose
group never returns does not hold it for ever. The model job of tests/test_goodput.py, its views
built as the service builds them: a real ViewBuilder fed each sweep's polls, a rank whose poll
failed kept with its last answer, unreachable."""

from __future__ import annotations

from unittest import mock

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

    def polled_view(self, at, ranks):
        polls = {url: RankPoll(url, True, data=rv.state, at=at) if rv.reachable
                 else RankPoll(url, False, reason="timeout", error="timed out", at=at)
                 for url, rv in ranks.items()}
        return self.builder.update([Target(url, "static") for url in ranks], polls, now=at)

    def sweep(self, ledger, dt: float = 1.0, pace: float = 1.0):
        # ModelJob's sweep, its view built from polls instead of from scratch
        with mock.patch("tests.test_goodput.scratch_view", self.polled_view):
            return super().sweep(ledger, dt, pace)


def gained(job: PolledJob, led: GoodputLedger, seconds: float, pace: float) -> float:
    """The goodput of ``seconds`` at ``pace`` (half-second sweeps)."""
    before = led.to_json()["job"]["goodput_seconds"]
    job.run(led, seconds, pace=pace, dt=0.5)
    return led.to_json()["job"]["goodput_seconds"] - before


def test_a_dead_group_that_never_returns_leaves_the_survivors_step_as_the_baseline():
    """No warm-up: group 1 dies 1.8 s after the ranks were first seen, the survivors stall 5.3 s
    until the quorum drops it (its dead_rank finding confirmed and evicted meanwhile), and it
    never returns. The baseline is the survivors' step, not one stretched by the stall (1.6x
    before), so a later 1.3x slowdown is not all goodput."""
    job, led = PolledJob(), GoodputLedger()
    job.run(led, 1.5, dt=0.5)
    job.sweep(led, 0.3)
    onset = job.t
    job.groups[1].update(reach=False, **{"in": False})  # its processes are gone
    job.run(led, 4.0, pace=0.0, dt=0.5)
    job.finding("dead_rank", 1, first_seen=onset, confirmed_at=job.t, fid=1)
    job.sweep(led, 0.5, pace=0.0)
    job.evict(1, at=job.t, did=1, fid=1)
    job.evictions[-1]["status"] = "confirmed"
    job.sweep(led, 0.8, pace=0.0)  # 5.3 s of stall in all
    job.run(led, 40, dt=0.5)
    out = led.to_json()
    [inc] = out["incidents"]
    assert inc["open"] and inc["kind"] == "dead_rank" and inc["back_to_pace"] == "reached"
    assert out["baseline"]["step_seconds"] == pytest.approx(STEP, rel=0.1)
    assert out["baseline"]["samples"] >= 30  # matured: frozen by the open incident from here
    assert out["baseline"]["frozen"] == f"incident {inc['id']} open"
    assert out["pace"]["ratio"] == pytest.approx(1.0, abs=0.1)
    assert inc["cost"]["by_cause"]["capacity_lost"] > 30  # its group, out for good
    slow = gained(job, led, 10, pace=1 / 1.3)  # the two survivors 1.3x slower for 10 s
    # its commits' worth, but the first ~1.7 s: the 4 s pace window still at pace over them
    assert slow == pytest.approx(2 * 10 / 1.3, abs=1.0)
    out = led.to_json()
    assert out["baseline"]["step_seconds"] == pytest.approx(STEP, rel=0.1)
    # the slow time waits for an explanation (the dead group's incident is none)
    assert out["job"]["pending_seconds"] == pytest.approx(2 * 10 * (1 - 1 / 1.3), abs=1)
    # before the baseline formed, the survivors' stall too is startup's
    assert {c for c, v in out["job"]["badput_seconds"].items() if v} == {
        "startup", "capacity_lost"}
    assert set(out["incidents"][0]["cost"]["by_cause"]) == {"capacity_lost"}
    check_counted(job, led)


def test_a_baseline_formed_before_a_slow_fault_was_confirmed_is_unset_again():
    """A straggler from 2 s in, confirmed 16 s later: the baseline formed meanwhile from its
    slowed sweeps alone. On the confirmation it has no sample left and is unset (not kept at
    the straggler's step); once the job went on after the eviction it forms at the healthy
    step, though the evicted group never returns."""
    job, led = PolledJob(), GoodputLedger()
    job.run(led, 2)
    onset = job.t
    job.run(led, 16, pace=0.3)
    assert led.to_json()["baseline"]["step_seconds"] == pytest.approx(STEP / 0.3, rel=0.1)
    job.finding("straggler", 1, first_seen=onset, confirmed_at=job.t, fid=1)
    job.sweep(led, pace=0.3)
    out = led.to_json()
    assert out["baseline"] == {"step_seconds": None, "samples": 0, "window_samples": 120,
                               "frozen": "incident 1 open"}
    job.evict(1, at=job.t, did=1, fid=1)
    job.evictions[-1]["status"] = "confirmed"
    job.run(led, 40)
    out = led.to_json()
    [inc] = out["incidents"]
    assert inc["open"] and inc["cost"]["by_cause"]["straggler_drag"] > 0
    assert out["baseline"]["step_seconds"] == pytest.approx(STEP, rel=0.1)
    assert out["pace"]["ratio"] == pytest.approx(1.0, abs=0.1)
    check_invariant(led)
    check_counted(job, led)


def test_a_young_baseline_is_held_by_an_incident_not_acted_on_for_the_horizon_at_most():
    """A hang found while the baseline is young, never evicted nor cleared: no sample from its
    onset for the horizon, then the young baseline takes samples again."""
    job, led = PolledJob(), GoodputLedger(GoodputConfig(horizon_s=20.0))
    job.run(led, 15)
    young = led.to_json()["baseline"]
    assert young["step_seconds"] == pytest.approx(STEP, rel=0.05) and young["samples"] < 30
    onset = job.t
    job.run(led, 3, pace=0.0)
    job.finding("hang", 1, first_seen=onset, confirmed_at=job.t, fid=1)
    job.run(led, 10)  # the job went on, but the hang was never acted on
    out = led.to_json()
    assert out["baseline"]["frozen"] == "incident 1 open"
    assert out["baseline"]["samples"] == young["samples"]
    job.run(led, 10)
    out = led.to_json()
    assert out["incidents"][0]["open"] and out["baseline"]["frozen"] is None
    assert out["baseline"]["samples"] > young["samples"]
    assert out["baseline"]["step_seconds"] == pytest.approx(STEP, rel=0.05)
    check_invariant(led)
