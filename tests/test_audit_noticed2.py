"""Audit of the monitor's noticed defects: an evicted group's exit is no ``dead`` finding, and
more (each test says which)."""

from __future__ import annotations

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_monitor_detectors import T0, Job


def test_an_evicted_incarnation_going_is_no_dead_finding_a_crash_beside_it_is():
    job = Job()
    det = Detectors(DetectorConfig(dead_sweeps=2))
    job.steps(5, now=T0)
    evicted = {job.states[2]["replica_id"]}  # group 1 killed through the Lighthouse

    def sweep(now):
        view = job.view(now)
        return det.update(view, None, now, evicted=evicted)

    sweep(T0)
    job.down = {2}  # the kill ends group 1's Manager (rank 0) first
    found = [f for t in (1, 2, 3) for f in sweep(T0 + t)]
    job.down = {2, 3, 4}  # then its rank 1 told to exit; group 2's Manager crashes on its own
    found += [f for t in (4, 5, 6) for f in sweep(T0 + t)]
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("dead", 2, [4])]
