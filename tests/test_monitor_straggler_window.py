"""A straggler confirmed on one window when every step of it is late (issue 17): at 100,000
ranks one sweep spans several steps, and the second window cost a whole sweep. A window with
a step on time still needs the consecutive windows. The job is tests/test_monitor_detectors.py's
synthetic FT-HSDP job (its /v1/state documents with per-step timings)."""

from __future__ import annotations

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_monitor_detectors import T0, Job, sweep


def stragglers(found) -> list[tuple[str, int]]:
    return [(f.kind, f.replica_group) for f in found]


def test_every_step_of_one_window_late_confirms_at_once():
    job = Job()
    det = Detectors(DetectorConfig(straggler_steps=6, straggler_windows=2))
    job.steps(10, now=T0)
    assert sweep(det, job, T0) == []
    job.steps(6, late_group={2: 0.5}, now=T0 + 1)  # one sweep sees 6 late steps
    assert stragglers(sweep(det, job, T0 + 1)) == [("straggler", 2)]


def test_a_window_with_a_step_on_time_waits_for_the_next_window():
    job = Job()
    det = Detectors(DetectorConfig(straggler_steps=6, straggler_windows=2))
    job.steps(11, now=T0)
    assert sweep(det, job, T0) == []
    job.steps(5, late_group={2: 0.5}, now=T0 + 1)  # 5 of the window's 6 late: a candidate
    assert sweep(det, job, T0 + 1) == []
    job.steps(1, late_group={2: 0.5}, now=T0 + 2)  # the next window, with a newer step
    assert stragglers(sweep(det, job, T0 + 2)) == [("straggler", 2)]


def test_first_seen_is_when_the_first_late_step_began_not_when_a_window_was_judged():
    """The ranks' own step durations date the evidence: the cost of a straggler (its ledger
    onset where no rank reports a fault strike) counts from its first late step. Here one sweep
    a second, two steps of ~0.5 s in each, so the clock and the steps agree."""
    job = Job()
    det = Detectors(DetectorConfig(straggler_steps=6, straggler_windows=2))
    job.steps(10, now=T0)
    assert sweep(det, job, T0) == []  # the last sweep before group 2 turns late
    found = []
    for t in range(1, 5):
        job.steps(2, late_group={2: 0.4}, noise=0.0, now=T0 + t)
        found += sweep(det, job, T0 + t)
    [f] = [f for f in found if f.kind == "straggler"]
    assert f.replica_group == 2 and f.confirmed_at >= T0 + 3
    assert f.evidence["summary"].startswith("the other groups wait for replica group 2 at the "
                                            "cross-group step: 0.4")
    assert T0 - 0.3 <= f.first_seen <= T0 + 0.3, (f.first_seen - T0, f.confirmed_at - T0)
