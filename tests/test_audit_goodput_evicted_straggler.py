"""An evicted straggler drags nothing: slow time long after its eviction (the job back at pace, its
group never back) is not booked as its ``straggler_drag`` (docs/goodput.md: slow commits while
a straggler finding is open), it waits for an explanation like any unexplained slowness.

The job is test_goodput's model (synthetic rank states in a real ClusterView), not torchft: a
slowdown of the survivors tens of seconds after an eviction, at an exact pace, is not something
a real 2-core run produces on cue."""

from __future__ import annotations

import pytest

from tests.test_goodput import check_invariant, healthy_ledger


def test_slow_time_long_after_a_stragglers_eviction_is_not_its_drag():
    job, led = healthy_ledger(seconds=40)
    onset = job.t
    job.groups[1]["struck"] = {"slow:delay=0.6": onset + 0.1}
    job.run(led, 6, pace=0.3)
    job.finding("straggler", 1, first_seen=onset + 0.1, confirmed_at=job.t, fid=11)
    job.run(led, 1, pace=0.3)
    job.evict(1, at=job.t + 0.1, did=5, fid=11)
    job.findings.clear()  # its group gone, the straggler finding resolves
    job.run(led, 2, pace=0.0)
    job.run(led, 30, pace=1.0)
    [inc] = led.to_json()["incidents"]
    assert inc["kind"] == "straggler" and inc["back_to_pace"] == "reached"
    drag = inc["cost"]["by_cause"]["straggler_drag"]
    assert drag > 0

    job.run(led, 20, pace=0.6)  # the survivors slow down, for a reason nobody found yet
    out = led.to_json()
    [inc] = out["incidents"]
    assert inc["cost"]["by_cause"]["straggler_drag"] == pytest.approx(drag, abs=1e-6)
    assert out["job"]["badput_seconds"]["straggler_drag"] == pytest.approx(drag, abs=0.01)
    assert out["job"]["pending_seconds"] == pytest.approx(2 * 20 * 0.4, rel=0.15)
    check_invariant(led)
