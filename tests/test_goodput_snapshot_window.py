"""The goodput snapshot's pace window stays bounded however slow the steps (rows a step apart,
not a sweep apart), and a monitor restarted from it paces each group as the one that did not
restart, within a step: 200 groups, 10 s steps, swept every second."""

from __future__ import annotations

import json
import math

import numpy as np

from monitor.evidence.view import RankView
from monitor.goodput import GoodputLedger
from tests.support.views import scratch_view

T0 = 1_700_000_000.0
PACES = (1.0, 0.95, 0.8, 0.5)  # group g commits this share of the job's steps


class SlowStepJob:
    """``groups`` one-rank groups; the job's step moves every ``step_s`` seconds, group g
    committing ``PACES[g % 4]`` of them. A view is made only when a step moves (the same
    states otherwise: the sweeps between are ones where nothing changed)."""

    def __init__(self, groups: int, step_s: float = 10.0) -> None:
        self.n, self.step_s, self.t, self.step = groups, step_s, T0, 0
        self.commits = [0] * groups
        self.view = self._view()

    def _view(self):
        ranks = {}
        for g in range(self.n):
            url = f"http://h{g}:1"
            ranks[url] = RankView(url, True, {
                "replica_group": g, "rank": g, "group_rank": 0, "group_world_size": 1,
                "step": self.step, "quorum_id": 7, "phase": "forward", "phase_since": T0,
                "participating": True, "replica_id": f"g{g}:a", "commits": self.commits[g]})
        return scratch_view(self.t, ranks=ranks)

    def advance(self, dt: float = 1.0):
        self.t += dt
        k = int((self.t - T0) / self.step_s)
        if k != self.step:
            for s in range(self.step + 1, k + 1):
                for g in range(self.n):
                    p = PACES[g % len(PACES)]
                    self.commits[g] += math.floor(s * p) - math.floor((s - 1) * p)
            self.step = k
            self.view = self._view()
        return self.view


def paces(led: GoodputLedger) -> np.ndarray:
    """Each group's pace over the pace window, as the ledger judges it."""
    S = led.slots
    return led.hist.pace(np.arange(1, len(S)), S.born, led.job.window, led.baseline)


def test_the_saved_pace_window_is_a_step_apart_and_paces_as_without_a_restart():
    job, led = SlowStepJob(200), GoodputLedger()
    while led.baseline is None:  # startup, swept less often (the test's time)
        led.update(job.advance(2.5), [], [], job.t)
    for _ in range(210):  # a whole window of sweeps a second apart
        led.update(job.advance(), [], [], job.t)
    b, window = led.baseline, led.job.window
    assert 8 < b < 12 and window < 210  # ~20 steps of ~10 s
    state = json.loads(json.dumps(led.snapshot()))
    assert len(state["groups"]["window"]["t"]) <= 41
    resumed = GoodputLedger.restore(led.cfg, state, [], [])
    for _ in range(20):
        view = job.advance()
        led.update(view, [], [], job.t)
        resumed.update(view, [], [], job.t)
        was, now = paces(led), paces(resumed)
        assert (np.isnan(was) == np.isnan(now)).all() and not np.isnan(was).all()
        # one step more or less over the window at most
        assert np.nanmax(np.abs(was - now)) <= b / window + 1e-9
