"""The ranks' commit times (``last_step_at``) on a clock behind or ahead of the monitor's: the
ledger still forms its baseline, and a recovery still ends (docs/goodput.md, "back_to_pace_at")."""

from __future__ import annotations

import pytest

from monitor.goodput import GoodputConfig, GoodputLedger
from tests.test_goodput import ModelJob


class SkewedJob(ModelJob):
    """A job whose ranks' clocks are ``skew`` seconds behind the monitor's (negative: ahead)."""

    skew = 0.0

    def ranks(self):
        out = super().ranks()
        for rv in out.values():
            if rv.state.get("last_step_at") is not None:
                rv.state["last_step_at"] -= self.skew
        return out


def skewed(skew: float) -> tuple[SkewedJob, GoodputLedger]:
    job = SkewedJob(3)
    job.commit_times, job.skew = True, skew
    return job, GoodputLedger(GoodputConfig())


@pytest.mark.parametrize("skew", [0.6, 2.0, 30.0, -0.6, -30.0])
def test_a_skewed_rank_clock_still_forms_the_baseline(skew):
    job, led = skewed(skew)
    job.run(led, 30, dt=0.5)
    out = led.to_json()
    assert out["baseline"]["step_seconds"] == pytest.approx(0.2, rel=0.1)
    assert out["pace"]["ratio"] >= 0.9
    assert out["job"]["goodput_seconds"] > 0.5 * out["job"]["expected_seconds"]


def _evicted_hang_recovery(job, led) -> dict:
    """Group 2 hangs 3 s, is evicted and the job trains on: its incident."""
    job.finding("hang", 2, first_seen=job.t, confirmed_at=job.t + 2, fid=5)
    job.run(led, 3, pace=0.0, dt=0.5)
    job.evict(2, at=job.t, did=9, fid=5)
    job.run(led, 30, pace=1.0, dt=0.5)
    [inc] = led.to_json()["incidents"]
    return inc


@pytest.mark.parametrize("skew", [0.0, 0.6, 2.0, -2.0])
def test_an_evicted_hang_reaches_back_to_pace_with_a_skewed_rank_clock(skew):
    job, led = skewed(skew)
    job.run(led, 30, dt=0.5)
    inc = _evicted_hang_recovery(job, led)
    assert inc["back_to_pace"] == "reached"
    # the stall (3 s) plus a window of evidence; an unskewed clock gives 3.4 s
    assert inc["recovery_s"] == pytest.approx(3.4, abs=0.6)


def test_a_rank_clock_stepping_back_after_the_baseline_still_ends_the_recovery():
    job, led = skewed(0.0)
    job.run(led, 30, dt=0.5)
    assert led.to_json()["baseline"]["step_seconds"] == pytest.approx(0.2, rel=0.1)
    job.skew = 2.0
    job.run(led, 30, dt=0.5)
    inc = _evicted_hang_recovery(job, led)
    assert inc["back_to_pace"] == "reached"
    assert inc["recovery_s"] == pytest.approx(3.4, abs=0.6)
