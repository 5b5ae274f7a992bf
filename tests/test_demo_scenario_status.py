"""The demo's status line once its scenario is over: with ``--keep-running`` it ticks on with
that line, which must say the run is kept running, not that it still waits for the ledger."""

from __future__ import annotations

import argparse

import pytest

from lightkeeper.demo_loop import Stop
from lightkeeper.demo_stories import Stories
from lightkeeper.scenario import FaultPlan, Scenario


class _Scenario(Stories):
    """The scenario's loop on a clock, one live fault whose story ends at once; every status
    it shows is noted."""

    def __init__(self, keep_running: bool) -> None:
        self.args = argparse.Namespace(keep_running=keep_running, soak=None)
        self.sc = Scenario(faults=[FaultPlan(1, "hang")])
        self.soaking, self.tracks, self.faults, self.clock = False, [], [], 0.0
        self.shown: list[str] = []

    def now(self) -> float:
        return self.clock

    def wait(self, pred, timeout: float) -> bool:
        self.shown.append(self.status)
        if pred():
            return True
        self.clock += timeout
        return False

    def inject_live(self, plan: FaultPlan) -> None:
        pass

    def event(self, kind, group, detail) -> None:
        pass


@pytest.mark.parametrize("keep_running", [True, False])
def test_the_status_says_the_scenario_is_over_once_it_is(keep_running):
    demo = _Scenario(keep_running)
    demo.run_scenario()
    assert "waiting for the monitor's ledger to see the job back at pace" in demo.shown
    assert demo.status.startswith("scenario over")
    assert ("kept running" in demo.status) == keep_running


@pytest.mark.parametrize("keep_running", [True, False])
def test_a_scenario_stopped_by_its_duration_says_it_is_over(keep_running):
    """--duration ends the scenario mid-story (Stop): the kept-running ticks must not go on
    showing the story's last stage."""
    demo = _Scenario(keep_running)

    def stopped(pred, timeout):
        demo.shown.append(demo.status)
        raise Stop("every group trained 8 steps")

    demo.wait = stopped
    with pytest.raises(Stop):
        demo.run_scenario()
    assert demo.shown[-1] != demo.status
    assert demo.status.startswith("scenario over")
    assert ("kept running" in demo.status) == keep_running
