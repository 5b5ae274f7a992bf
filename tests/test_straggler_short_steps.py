"""Steps of ms, sweeps of a second: a hundred steps pass between two answers of a rank, so the
monitor holds only what each rank serves at that moment, and the ranks answer a few steps
apart (a sweep polls them over some ms). The straggler's window must still be common to every
rank; when it cannot be, the monitor says so once and serves no stale arrival lag.

The ranks' rows come from real step timers (worker_server/timing.py), so what a rank serves is
what a WorkerServer serves; the job is tests/test_monitor_detectors.py's synthetic one."""

from __future__ import annotations

import logging
import random

from monitor.detect import Detectors
from tests.support.clock import ManualClock
from tests.test_monitor_detectors import T0, Job, sweep
from worker_server.timing import StepTimer

STEP_S = 0.01
PER_SWEEP = 100  # steps between two sweeps: 10 ms steps, 1 s sweeps
LATE = {1: 0.02}  # group 1 arrives 20 ms late every step: the job runs ~3x slower


class Ranks:
    """Each rank of ``job`` with its own step timer, driven step by step."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.clocks = [ManualClock() for _ in job.states]
        self.timers = [StepTimer(clock=c, device=False) for c in self.clocks]
        self.done = [0] * len(job.states)  # the next step each rank runs

    def _step(self, rank: int, step: int) -> None:
        g, clock, timer = self.job.group_of(rank), self.clocks[rank], self.timers[rank]
        rng = random.Random(rank * 1_000_003 + step)
        worst = max(LATE.values())
        timer.begin_step()
        with timer.waiting("cross"):
            clock.advance(0.005 + rng.uniform(0, 0.002) + worst - LATE.get(g, 0.0))
        clock.advance(STEP_S * 0.3)
        with timer.waiting("group"):
            clock.advance(0.003 + rng.uniform(0, 0.002))
        timer.end_step(step)

    def answer(self, now: float, ahead: dict[int, int]) -> None:
        """``PER_SWEEP`` more steps; each rank of group g answers ``ahead[g]`` steps further."""
        self.job.steps(PER_SWEEP, now=now)  # the job's other fields and its Flight Recorders
        for r, s in enumerate(self.job.states):
            target = self.job.step + ahead.get(self.job.group_of(r), 0)
            for step in range(self.done[r], target):
                self._step(r, step)
            self.done[r] = max(self.done[r], target)
            s["timing"] = self.timers[r].snapshot()
            s["step"] = self.done[r]


def kinds(found) -> list[tuple[str, int | None]]:
    return [(f.kind, f.replica_group) for f in found]


def test_a_straggler_is_found_with_ranks_answering_eleven_steps_apart():
    job = Job(groups=3, ranks=2, step_s=STEP_S)
    ranks, det, now, found = Ranks(job), Detectors(), T0, []
    for _ in range(6):
        now += 1.0
        ranks.answer(now, ahead={2: 11})
        found += kinds(sweep(det, job, now))
    assert ("straggler", 1) in found
    assert det.last_lags[1] > 0.01 and det.last_lags[0] == 0.0


def test_ranks_too_far_apart_say_so_once_and_serve_no_stale_lag(caplog):
    job = Job(groups=3, ranks=2, step_s=STEP_S)
    ranks, det, now = Ranks(job), Detectors(), T0
    caplog.set_level(logging.INFO, logger="monitor.detect.straggler")

    def sweeps(n: int, ahead: dict[int, int]) -> list:
        nonlocal now
        out = []
        for _ in range(n):
            now += 1.0
            ranks.answer(now, ahead)
            out += kinds(sweep(det, job, now))
        return out

    assert sweeps(1, {}) == [("straggler", 1)]  # every step of the window late: at once
    assert det.last_lags[1] > 0.01  # group 1's lag served
    # group 2 answers 40 steps ahead, more than any rank keeps: no window common to all
    assert sweeps(3, {2: 40}) == []
    assert det.last_lags == {}  # the gauge does not keep the last window's lag
    apart = [r for r in caplog.records if "share no 6 steps" in r.getMessage()]
    assert len(apart) == 1 and apart[0].levelno == logging.WARNING
    assert "stragglers are not judged" in apart[0].getMessage()
    # back in step: judged again (still late: its finding stays open), said once
    assert sweeps(2, {}) == []
    assert det.last_lags[1] > 0.01
    assert kinds(det.open_findings()) == [("straggler", 1)]
    again = [r for r in caplog.records if "share a window again" in r.getMessage()]
    assert len(again) == 1
