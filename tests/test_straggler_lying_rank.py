"""One rank's timing rows must not get a healthy group evicted as a straggler.

A real Monitor against a real torchft Lighthouse that simulated groups join (``SimJob``), 3
replica groups of 2 ranks, sweeps driven by the test (tests/test_monitor_network.py's harness).
One verified rank of group 0 serves rows that say it waited 5 s a step across groups while
every other rank, its group peer included, steps healthily: impossibly (its waits over its step
time: no valid row) or self-consistently (its step 5 s longer too). Either way no group is a
straggler and nothing is evicted; a real straggler beside the liar is still found and evicted,
and so is one rank late only at the cross-group step (its counterparts wait there, every other
rank in its group's commit vote: why a group's cross wait is its most-waiting rank's).
"""

from __future__ import annotations

import random

import pytest

from tests.support.monitor_sim import SimJob
from tests.test_monitor_network import HEALTHY, Clock, Driver, monitor

LIE = 5.0
# the liar's rows: waits over the step (no valid row), or a step that holds them (valid)
IMPOSSIBLE = {"compute_s": 0.0, "wait_cross_s": LIE, "wait_group_s": 0.0}
CONSISTENT = {"wait_cross_s": LIE}
LATE = 0.4  # a real straggler's lag a step


class Training:
    """Per-step rows written into the simulated ranks, each rank's own: ``own(g, i)`` the
    seconds of group ``g``'s ``i``-th rank (``step_s`` their sum unless it says otherwise)."""

    def __init__(self, job: SimJob) -> None:
        self.job, self.rng, self.step = job, random.Random(0), 100
        self.own = lambda g, i: HEALTHY
        for r in job.sim.ranks:
            g = r.state["replica_group"]
            r.update(host=f"h{g}", node=f"node-{g}", step=self.step,
                     timing={"recent": [], "waiting": None, "last_step": None, "window": None})

    def steps(self, n: int, now: float) -> None:
        for _ in range(n):
            self.step += 1
            for g in self.job.alive:
                for i, r in enumerate(self.job.sim.group(g)):
                    own = self.own(g, i)
                    row = {k: v * (1 + self.rng.uniform(-0.1, 0.1)) for k, v in own.items()
                           if k != "step_s"}
                    row["step_s"] = own.get("step_s", sum(row.values()))
                    row["step"] = self.step
                    t = r.state["timing"]
                    t = {**t, "recent": (t["recent"] + [row])[-16:], "last_step": row}
                    r.update(timing=t, step=self.step, commits=self.step, phase="forward",
                             phase_since=now, last_step_at=now,
                             recent_step_seconds=[x["step_s"] for x in t["recent"]])


@pytest.fixture
def job():
    j = SimJob(3, ranks_per_group=2, heartbeat_timeout_ms=1000)
    yield j
    j.stop()


@pytest.fixture
def driver(tmp_path, job):
    clock = Clock()
    mon = monitor(tmp_path, job, clock)
    yield Driver(mon, Training(job), clock)
    mon.stop()


def lying(lie: dict):
    """Group 0's second rank serves ``lie``; every other rank is healthy."""
    def own(g: int, i: int) -> dict:
        if (g, i) != (0, 1):
            return HEALTHY
        if lie is IMPOSSIBLE:
            return {**lie, "step_s": sum(HEALTHY.values())}
        return {**HEALTHY, **lie}
    return own


def stragglers(d: Driver) -> list[tuple[int, str]]:
    return [(f["replica_group"], f["evidence"]["summary"]) for f in d.mon.store.findings()
            if f["kind"] == "straggler"]


def evictions(d: Driver) -> list[int]:
    return [e["replica_group"] for e in d.mon.store.decisions(decision="evict")]


@pytest.mark.parametrize("lie", [IMPOSSIBLE, CONSISTENT], ids=["impossible", "consistent"])
def test_one_lying_rank_gets_no_group_evicted_and_a_real_straggler_still_is(driver, job, lie):
    d = driver
    d.train.own = lying(lie)
    d.sweeps(12)  # 36 steps: windows of 6 judged, a straggler confirmed in two
    assert stragglers(d) == [] and evictions(d) == [] and job.kills == []
    assert "straggler" not in d.open_kinds()
    # judged all along: every group's lag served, none waited for
    lags = {g["replica_group"]: g["arrival_lag_seconds"] for g in d.mon.cluster_json()["groups"]}
    assert set(lags) == {0, 1, 2} and all(v is not None and v < 0.1 for v in lags.values()), lags

    # group 2 computes 0.4 s longer a step, every other rank waits for it across groups (the
    # liar goes on lying): group 2 is the straggler, found and evicted, and only it
    def slow(g: int, i: int) -> dict:
        if g == 2:
            return {**HEALTHY, "compute_s": HEALTHY["compute_s"] + LATE}
        own = lying(lie)(g, i)
        if "step_s" in own:  # the impossible liar lies on
            return own
        return {**own, "wait_cross_s": max(own["wait_cross_s"], HEALTHY["wait_cross_s"] + LATE)}
    d.train.own = slow
    d.until(lambda: job.kills, "the straggler's eviction", sweeps=8)
    assert [g for g, _ in stragglers(d)] == [2] and evictions(d) == [2]
    assert job.kills == [job.replica_ids[2]]


def test_a_rank_late_only_at_the_cross_group_step_is_found(driver, job):
    """``slow:delay`` on one rank (it sleeps before its cross-group all_reduce, after its
    group's last FSDP collective): only the other groups' second ranks wait for it there,
    their first ranks and its own group peer wait in the commit vote. Its group is the
    straggler, and it the rank its peer waits for."""
    late, on_time = HEALTHY["wait_cross_s"] + LATE, HEALTHY["wait_group_s"] + LATE

    def own(g: int, i: int) -> dict:
        if (g, i) == (1, 1):
            return {**HEALTHY, "compute_s": HEALTHY["compute_s"] + LATE}
        return {**HEALTHY, "wait_cross_s": late} if i == 1 and g != 1 else \
            {**HEALTHY, "wait_group_s": on_time}
    d = driver
    d.train.own = own
    d.until(lambda: job.kills, "the straggler's eviction", sweeps=12)
    (f,) = [f for f in d.mon.store.findings() if f["kind"] == "straggler"]
    assert f["replica_group"] == 1 and f["evidence"]["median_lag_s"] == pytest.approx(LATE,
                                                                                      abs=0.08)
    assert f["ranks"] == [job.sim.group(1)[1].state["rank"]]
    assert evictions(d) == [1] and job.kills == [job.replica_ids[1]]
