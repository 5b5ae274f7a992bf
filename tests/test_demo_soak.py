"""The soak's schedule and its summary (``lightkeeper demo --soak``; lightkeeper/soak.py).

The soak itself runs for 20 minutes on namespaced hosts: a benchmark, not a test
(benchmarks/results/README.md). Here: the seeded schedule covers every kind of the grammar and
repeats with its seed, and the summary's arithmetic on a report whose figures are known.
"""

from __future__ import annotations

import argparse
from itertools import islice

import pytest

from lightkeeper import soak as soak_mod
from lightkeeper.demo_sampling import Sampling
from lightkeeper.demo_stories import Stories
from lightkeeper.scenario import FaultPlan, Scenario, parse_inject, soak_faults, soak_schedule
from lightkeeper.soak import summary, table
from trainer.faults import KINDS as PROCESS_KINDS
from trainer.faults import NETWORK_KINDS


def test_schedule_every_kind_first_and_seeded():
    plans = soak_faults(7, groups=3, ranks_per_group=2, network=True, count=20)
    kinds = set(PROCESS_KINDS) | set(NETWORK_KINDS)
    assert {p.kind for p in plans[:len(kinds)]} == kinds
    assert plans == soak_faults(7, groups=3, ranks_per_group=2, network=True, count=20)
    assert plans != soak_faults(8, groups=3, ranks_per_group=2, network=True, count=20)
    for p in plans:
        assert 0 <= p.replica_group < 3
        assert p.group_rank is None if p.kind in NETWORK_KINDS or p.kind == "slow" \
            else 0 <= p.group_rank < 2


def test_schedule_without_namespaced_hosts_has_no_network_fault():
    plans = soak_faults(3, groups=2, ranks_per_group=1, network=False, count=30)
    assert not {p.kind for p in plans} & set(NETWORK_KINDS)
    assert {p.kind for p in plans} == set(PROCESS_KINDS)


def test_live_specs_parse_for_every_kind():
    """What the demo injects live for each kind is a spec the trainer's grammar accepts."""
    import argparse

    from lightkeeper.demo import Demo
    from lightkeeper.scenario import FaultPlan, Scenario

    demo = Demo.__new__(Demo)
    demo.sc, demo.args = Scenario(), argparse.Namespace(ranks_per_group=2)
    for kind in (*PROCESS_KINDS, *NETWORK_KINDS):
        rank = None if kind in NETWORK_KINDS or kind == "slow" else 1
        spec = demo.live_spec(FaultPlan(0, kind, group_rank=rank), 40)
        placement = "0" if rank is None else "0.1"
        assert parse_inject(f"{placement}:{spec}", 3, 2).kind == kind


def _fault(kind, group, struck, rejoined, tf, **kw):
    return {"spec": f"{kind}:at_step=1", "replica_group": group, "group_rank": kw.get("rank"),
            "rank": kw.get("global_rank"), "host": kw.get("host"), "outcome": "recovered",
            "struck_at_s": struck, "injected_at_s": struck - 1, "detected_at_s": struck + 2,
            "detected_kind": kind, "culprit_ranks": kw.get("culprits"),
            "culprit_hosts": kw.get("hosts"), "recovery_s_ranks": 5.0, "steps_lost": 10,
            "rejoined_at_s": rejoined, "host_quarantined_at_s": None, "restarted_on": None,
            "torchft_alone": tf}


def test_summary_goodput_against_fault_free_and_torchft_alone():
    # healthy 2 steps/s from t=10 to t=110: 200 steps without faults; the ranks committed 150
    samples = [{"last_step_at_s": 10.0 + t, "step": int(1.5 * t)} for t in range(0, 101)]
    # its job_steps (80) also count the capacity lost after the stall: not commits lost
    hang = _fault("hang", 1, 30.0, 40.0, {"recovery_s": 25.0, "stall_s": 25.0, "job_steps": 80},
                  rank=1, global_rank=3, culprits=[3], hosts=["node-1"], host="node-1")
    part = _fault("partition", 0, 60.0, 70.0, {"recovery_s": None, "stall_s": 50.0,
                                                "job_steps": 100}, host="node-0",
                  hosts=["node-0"])
    # two stragglers that overlap: the job runs at the slower one's pace (0.5 then 1 step/s
    # lost of 2), not at the sum of both drags
    slow1 = _fault("slow", 2, 20.0, None, {"recovery_s": None, "stall_s": 0.0,
                                           "job_steps": 45}, host="node-2")  # 0.5/s over 90 s
    slow2 = _fault("slow", 2, 25.0, None, {"recovery_s": None, "stall_s": 0.0,
                                           "job_steps": 85}, host="node-2")  # 1/s over 85 s
    rep = {"faults": [hang, part], "duration_s": 110.0, "training_started_at_s": 10.0,
           "healthy_step_rate": 2.0,
           "evictions": [{"replica_group": 1, "decision": "evict", "at_s": 33.0},
                         {"replica_group": 0, "decision": "evict", "at_s": 63.0},
                         {"replica_group": 2, "decision": "evict", "at_s": 90.0},
                         {"replica_group": 0, "decision": "evict", "at_s": 80.0},
                         {"replica_group": 2, "decision": "hold", "at_s": 91.0}],
           "hosts": {"quarantined_at_s": {"node-1": 34.0, "node-0": 64.0}},
           "events": [{"t": 85.0, "kind": "repaired", "detail": "host node-0: partition lifted"}]}
    s = summary(rep, {"seed": 5, "soak_s": 100.0, "rss": [{"life": 1, "start_kb": 1}],
                      "restart": {"at_s": 50.0, "missing_after_restart": []}}, samples)
    g = s["goodput"]
    assert g["committed_steps"] == 150 and g["fault_free_steps"] == 200
    assert g["vs_fault_free"] == 0.75
    # torchft alone: the hang costs its 50 steps, the partition stops the job at t=60
    assert g["torchft_alone_stopped_for_good_at_s"] == 60.0
    assert g["torchft_alone_steps"] == 2 * (60 - 10) - 50
    assert g["vs_torchft_alone"] == 3.0
    # each row's torchft-alone loss is commits, as its steps_lost: the hang's stall at 2/s
    assert [r["torchft_alone_steps_lost"] for r in s["faults"]] == [50, 100]
    rep["faults"] = [slow1, slow2, part]
    g = summary(rep, {"seed": 5, "soak_s": 100.0}, samples)["goodput"]
    assert g["torchft_alone_steps"] == round(2 * 50 - 0.5 * 5 - 1.0 * 35)
    # the eviction of group 2 follows no fault of group 2: a false one; a hold is no eviction.
    # Group 0's at 80 s follows its partition (story over at 70 s) before node-0's repair
    assert [e["replica_group"] for e in s["false_evictions"]] == [2]
    assert s["evictions"] == 4
    assert s["faults"][0]["right_rank"] is True and s["faults"][0]["right_host"] is True
    assert s["faults"][1]["right_rank"] is None and s["faults"][1]["right_host"] is True
    assert s["quarantines"] == ["node-0", "node-1"]
    text = table(s)
    assert "seed 5" in text and "false 1" in text and "audit decisions lost: []" in text


def test_a_fault_whose_rank_never_reported_its_strike_has_its_host_unknown_not_wrong():
    samples = [{"last_step_at_s": 10.0 + t, "step": 2 * t} for t in range(0, 41)]
    unsaid = _fault("partition", 0, 20.0, 30.0, None, hosts=["node-0"])  # host: None
    said = _fault("partition", 1, 25.0, 35.0, None, host="node-2", hosts=["node-1"])
    rep = {"faults": [unsaid, said], "duration_s": 50.0, "training_started_at_s": 10.0,
           "healthy_step_rate": 2.0, "evictions": [], "hosts": {}, "events": []}
    rows = summary(rep, {"seed": 1, "soak_s": 40.0}, samples)["faults"]
    assert [r["right_host"] for r in rows] == [None, False]


def test_summary_says_a_soak_was_cut_short_and_what_torchft_alone_leaves_out():
    """A soak stopped by Ctrl-C/SIGTERM says so on its first line; a fault whose torchft-alone
    cost is not computed (a slow link; a crash is torchft's own) is named beside that figure,
    not silently counted as free."""
    samples = [{"last_step_at_s": 10.0 + t, "step": 2 * t} for t in range(0, 41)]
    link = _fault("slow_link", 2, 20.0, 30.0, None, host="node-2", hosts=["node-2"])
    crash = _fault("crash", 1, 25.0, 27.0, None, rank=0, global_rank=1)
    rep = {"faults": [link, crash], "duration_s": 50.0, "training_started_at_s": 10.0,
           "healthy_step_rate": 2.0, "outcome": "interrupted", "evictions": [], "hosts": {},
           "events": []}
    s = summary(rep, {"seed": 7, "soak_s": 150.0}, samples)
    assert s["outcome"] == "interrupted"
    assert s["goodput"]["torchft_alone_not_computed"] == ["slow_link"]
    text = table(s)
    assert text.startswith("soak (INTERRUPTED): seed 7, 40s of training")
    assert "slow_link not computed, counted as costing it nothing" in text
    rep["outcome"] = "completed"
    assert table(summary(rep, {"seed": 7, "soak_s": 150.0}, samples)).startswith("soak: seed 7")
    # stopped while the job was still starting: no training at all, not its 50 s of run time
    rep.update(outcome="interrupted", training_started_at_s=None, faults=[])
    assert summary(rep, {"seed": 7, "soak_s": 150.0}, [])["training_s"] == 0.0


def _as_first_soaks_drew(seed, groups, ranks_per_group, network, count=60):
    """The schedule as the first soaks drew it (a list of ``count``): their seeds must repeat."""
    import random

    from lightkeeper.scenario import RANK_KINDS

    rng = random.Random(seed)
    kinds = list(PROCESS_KINDS) + (list(NETWORK_KINDS) if network else [])
    order = rng.sample(kinds, len(kinds)) + [rng.choice(kinds) for _ in range(count)]
    plans = []
    for kind in order[:count]:
        rank = rng.randrange(ranks_per_group) if kind in RANK_KINDS else None
        plans.append(FaultPlan(rng.randrange(groups), kind, group_rank=rank))
    return plans


@pytest.mark.parametrize("seed,network", [(2026, True), (7, False)])
def test_schedule_is_endless_and_its_first_sixty_repeat_earlier_seeds(seed, network):
    plans = list(islice(soak_schedule(seed, 3, 2, network), 200))
    assert len(plans) == 200
    assert plans[:60] == _as_first_soaks_drew(seed, 3, 2, network)
    assert plans[:60] == soak_faults(seed, 3, 2, network)
    assert plans == list(islice(soak_schedule(seed, 3, 2, network), 200))
    assert {p.kind for p in plans[60:]} <= set(PROCESS_KINDS) | set(NETWORK_KINDS)


class _ClockedSoak(Stories):
    """The scenario's loop on a clock: each fault's story takes ``per_fault_s``."""

    def __init__(self, soak_s: float, faults: list[FaultPlan], per_fault_s: float = 30.0) -> None:
        self.args = argparse.Namespace(soak=soak_s, seed=11, groups=3, ranks_per_group=2)
        self.sc = Scenario(faults=faults)
        self.soaking, self.fabric, self.tracks, self.faults = True, None, [], []
        self.soak = {"seed": 11, "soak_s": soak_s, "rss": []}
        self.monitor_proc = argparse.Namespace(pid=None)
        self.clock, self.train_start_s, self.per_fault_s = 0.0, 0.0, per_fault_s
        self.injected: list[FaultPlan] = []
        self.events: list[tuple] = []
        self.unsettled_reason: str | None = None

    def now(self) -> float:
        return self.clock

    def wait(self, pred, timeout: float) -> bool:
        if pred():
            return True
        self.clock += timeout
        return False

    def inject_live(self, plan: FaultPlan) -> None:
        self.injected.append(plan)
        self.clock += self.per_fault_s

    def refill_spares(self, wait: bool) -> None:
        pass

    def unsettled(self) -> str | None:  # what of the last fault goes on (its check: below)
        return self.unsettled_reason

    def job_step(self) -> int:
        return int(self.clock)

    def event(self, kind, group, detail) -> None:
        self.events.append((kind, detail))


def test_a_soak_injects_faults_until_its_time_is_up_not_until_a_list_runs_out(monkeypatch):
    monkeypatch.setattr(soak_mod, "restart_monitor", lambda demo: {"at_s": demo.now()})
    demo = _ClockedSoak(3600.0, soak_faults(11, 3, 2, network=False))
    demo.run_scenario()
    # healthy 8 s, then a fault every 30 s while under 3600 s of training: 120, not 60
    assert len(demo.injected) == 120
    assert demo.injected == list(islice(soak_schedule(11, 3, 2, False), 120))
    assert 3600.0 <= demo.clock < 3600.0 + 30.0 + demo.sc.end_s
    assert 1800.0 <= demo.soak["restart"]["at_s"] < 1830.0
    assert summary({"faults": [], "duration_s": demo.clock, "evictions": []}, demo.soak,
                   [])["schedule_exhausted"] is False
    # a schedule that ends before the soak's time: the soak says so
    short = _ClockedSoak(3600.0, list(soak_faults(11, 3, 2, network=False)))
    short.run_scenario()
    assert len(short.injected) == 60
    assert summary({"faults": [], "duration_s": short.clock, "evictions": []}, short.soak,
                   [])["schedule_exhausted"] is True
    assert any("ran out" in d for k, d in short.events if k == "soak")


def test_a_soak_fault_waits_for_the_last_ones_effects_and_says_when_it_gave_up(monkeypatch):
    monkeypatch.setattr(soak_mod, "restart_monitor", lambda demo: {"at_s": demo.now()})
    demo = _ClockedSoak(100.0, soak_faults(11, 3, 2, network=False))
    demo.unsettled_reason = "group 0 still runs on quarantined host node-4"
    demo.run_scenario()
    # healthy 8 s, 90 s waiting, the fault at 98 s (30 s); the soak's time is up then
    assert len(demo.injected) == 1 and demo.clock == 8.0 + 90.0 + 30.0 + demo.sc.end_s
    said = [d for k, d in demo.events if k == "soak"]
    assert said[0] == ("not settled after 90s, the next fault injected all the same: group 0 "
                       "still runs on quarantined host node-4")


class _Group:
    def __init__(self, alive: bool = True) -> None:
        self._alive = alive

    def alive(self) -> bool:
        return self._alive


def test_what_of_an_earlier_fault_still_goes_on_holds_the_next_one_back(tmp_path):
    """Seed 11 injected a slow link onto node-4 1.7 s after node-4 was quarantined for an
    earlier fault (its drain due); seed 5 a fault 1 s after a group's cold restart, and while
    quarantines were held by the cap. Each of those is what the next fault waits out."""
    from lightkeeper.demo import Demo
    from tests.support.demo import demo_args

    demo = Demo(demo_args("--soak", "100"), Scenario(), tmp_path)  # node-0..2, spares 3, 4
    demo.cluster.groups = {g: _Group() for g in range(3)}
    ranks = [{"participating": True, "num_participants": 3, "step": 400}] * 2
    demo.latest = {g: list(ranks) for g in range(3)}
    demo.hosts_view = {"quarantined": [], "hosts": []}
    assert demo.unsettled() is None
    demo.latest = {g: [dict(ranks[0], step=20)] * 2 for g in range(3)}  # early on: no
    assert demo.unsettled() is None  # restarted monitor to wait for
    demo.latest = {g: list(ranks) for g in range(3)}
    demo.hosts_view = {"quarantined": ["node-1"], "hosts": []}
    assert demo.unsettled() == "group 1 still runs on quarantined host node-1"
    demo.hosts_view = {"quarantined": ["node-3"], "hosts": []}  # a spare's: one is still free
    assert demo.unsettled() is None
    demo.latest[2] = [ranks[0], {"participating": False, "num_participants": 2}]
    assert demo.unsettled() == "group 2 is not in a quorum of all 3 groups"
    demo.latest[2] = ranks[:1]  # restarted: one rank answers so far
    assert demo.unsettled() == "group 2 is not in a quorum of all 3 groups"
    demo.latest[2] = list(ranks)
    demo.cluster.groups[0] = _Group(alive=False)
    assert demo.unsettled() == "group 0 is not running"
    demo.cluster.groups[0] = _Group()
    demo.waiting[0] = 50.0
    assert demo.unsettled() == "group 0 is not running"
    demo.waiting.clear()
    demo.hosts_view = {"quarantined": ["node-3"], "hosts": [
        {"host": "node-2", "state": "suspect", "hold": {"reason": "dry_run"}},
        {"host": "node-4", "state": "suspect", "hold": {"reason": "cap", "detail": "2 of 2"}}]}
    assert demo.unsettled() == "host node-4's quarantine is held (cap)"
    demo.hosts_view = {"quarantined": ["node-3", "node-4"], "hosts": []}
    assert demo.unsettled() == "no spare host is free"
    # seed 11 injected a slow link 3.5 s after the monitor's restart: never judged, the
    # restarted monitor had no job-wide baseline yet (30 steps at its defaults)
    demo.hosts_view = {"quarantined": [], "hosts": []}
    demo.soak["restart"] = {"at_s": 122.0, "job_step": 380}
    assert demo.unsettled() == "the restarted monitor is taking its job-wide baseline"
    demo.soak["restart"]["job_step"] = 340
    assert demo.unsettled() is None


def _tf(recovery_s, stall_s, job_steps):
    return {"recovery_s": recovery_s, "stall_s": stall_s, "job_steps": job_steps}


def test_torchft_alone_integrates_one_pace_never_double_counting_a_stall():
    # healthy 4 steps/s from t=10 to t=110; a straggler at 20 s slows the job to 1 step/s
    # (torchft_alone: 3 steps/s lost over its 90 s), a hang at 30 s stalls it 25 s, a
    # partition at 70 s stops it for good: 40 + 10 + 0 + 15 steps
    samples = [{"last_step_at_s": 10.0 + t, "step": 3 * t} for t in range(0, 101)]
    slow = _fault("slow_compute", 2, 20.0, None, _tf(None, 0.0, 270), rank=1)
    hang = _fault("hang", 1, 30.0, 60.0, _tf(25.0, 25.0, 100), rank=1)
    part = _fault("partition", 0, 70.0, 80.0, _tf(None, 40.0, 160), host="node-0")
    rep = {"faults": [slow, hang, part], "duration_s": 110.0, "training_started_at_s": 10.0,
           "healthy_step_rate": 4.0, "evictions": [], "events": []}
    g = summary(rep, {"seed": 1, "soak_s": 100.0}, samples)["goodput"]
    assert g["torchft_alone_steps"] == 40 + 10 + 0 + 15
    assert g["torchft_alone_stopped_for_good_at_s"] == 70.0
    assert g["vs_torchft_alone"] == round(300 / 65, 2)
    # without the partition: the hang's stall is not charged at the healthy pace on top of
    # the straggler's drag; at least every step outside the stall at the straggler's pace
    rep["faults"] = [slow, hang]
    g = summary(rep, {"seed": 1, "soak_s": 100.0}, samples)["goodput"]
    assert g["torchft_alone_steps"] == 40 + 10 + 0 + 55
    assert g["torchft_alone_stopped_for_good_at_s"] is None
    # two overlapping stalls count once
    host = _fault("host_offline", 2, 40.0, 60.0, _tf(20.0, 20.0, 80), host="node-2")
    rep["faults"] = [hang, host]
    g = summary(rep, {"seed": 1, "soak_s": 100.0}, samples)["goodput"]
    assert g["torchft_alone_steps"] == 4 * (20 + 50)


def _false_evictions(faults, evictions, events) -> list[float]:
    samples = [{"last_step_at_s": 10.0 + t, "step": 2 * t} for t in range(0, 201)]
    rep = {"faults": faults, "duration_s": 210.0, "training_started_at_s": 10.0,
           "healthy_step_rate": 2.0, "hosts": {}, "events": events,
           "evictions": [{"replica_group": g, "decision": "evict", "at_s": t}
                         for g, t in evictions]}
    return [e["at_s"] for e in summary(rep, {"seed": 1, "soak_s": 200.0}, samples)
            ["false_evictions"]]


def _not_detected(group: int, struck: float | None, told: float) -> tuple[dict, dict]:
    f = _fault("slow_compute", group, 30.0, None, None, rank=1)
    f.update(outcome="not detected", detected_at_s=None, struck_at_s=struck)
    return f, {"t": told, "kind": "outcome", "replica_group": group,
               "detail": "fault 1: not detected (no finding in 60 s)"}


def _restarted(group: int, t: float) -> dict:
    return {"t": t, "kind": "restarted", "replica_group": group,
            "detail": "process exited (-15); supervisor restarted it (restart 1, warm spare)"}


def test_a_fault_explains_its_groups_evictions_until_the_group_restarts():
    # its story over (not detected at 90) with the fault still in group 1's processes
    missed, told = _not_detected(1, 30.0, 90.0)
    assert _false_evictions([missed], [(1, 120.0)], [told]) == []
    # the group restarted at 150: an eviction of the new incarnation is no fault's
    assert _false_evictions([missed], [(1, 120.0), (1, 180.0)],
                            [told, _restarted(1, 150.0)]) == [180.0]
    # a restart before the strike does not end its window; another group's is not its own
    assert _false_evictions([missed], [(1, 120.0), (2, 120.0)],
                            [_restarted(1, 20.0), told, _restarted(2, 100.0)]) == [120.0]


def test_a_fault_that_never_struck_explains_nothing_after_its_story():
    never, told = _not_detected(1, None, 90.0)  # injected at 29, never struck
    assert _false_evictions([never], [(1, 50.0), (1, 120.0)], [told]) == [120.0]
    # without its outcome event: its story was over when the next fault was injected
    hang = _fault("hang", 2, 150.0, 170.0, None, rank=1)
    assert _false_evictions([never, hang], [(1, 140.0), (1, 190.0)], []) == [190.0]


class _Reads(Sampling):
    """The demo's monitor reads against a monitor that lists its newest 500 rows."""

    def __init__(self) -> None:
        self.findings, self.evictions, self.goodput = [], [], None
        self._seen_findings, self._seen_evictions, self._q_seen = set(), set(), set()
        self.rows: list[dict] = []

    def monitor_get(self, path: str):
        if path.startswith("/v1/evictions"):
            return sorted(self.rows, key=lambda r: -r["id"])[:500]
        return [] if path.startswith("/v1/findings") else None

    def event(self, kind, group, detail) -> None:
        pass


def test_the_demo_keeps_every_decision_a_long_run_pushes_out_of_the_monitors_newest():
    demo = _Reads()
    for batch in range(3):
        demo.rows += [{"id": i, "replica_group": 0, "at": float(i), "decision": "hold",
                       "reason": "hang", "status": "held"} for i in range(batch * 300,
                                                                      (batch + 1) * 300)]
        demo.poll_monitor()
    assert [d["id"] for d in demo.evictions] == list(range(899, -1, -1))
    demo.rows[-1]["status"] = "lifted"  # a row still listed: its newest version
    demo.poll_monitor()
    assert demo.evictions[0]["status"] == "lifted" and len(demo.evictions) == 900


def test_back_at_own_pace_is_not_the_next_faults_recovery():
    """A straggler struck at 20 s, after which the job runs at 0.78x until a hang at 40 s; full
    pace again from 42 s: that is the hang's recovery, not the straggler's."""
    samples, step, t = [], 0, 0.0
    for until, dt, resume in ((20.0, 0.2, 22.0), (40.0, 1 / (0.78 * 5), 42.0), (60.0, 0.2, 60.0)):
        while t + dt <= until + 1e-9:
            t, step = round(t + dt, 3), step + 1
            samples.append({"last_step_at_s": t, "step": step})
        t = resume
    straggler = _fault("slow", 1, 20.0, 25.0, None)
    hang = _fault("hang", 2, 40.0, 45.0, None)
    rep = {"faults": [straggler, hang], "duration_s": 60.0, "training_started_at_s": 0.0,
           "healthy_step_rate": 5.0, "evictions": [], "hosts": {}, "events": []}
    rows = summary(rep, {"seed": 1, "soak_s": 60.0}, samples)["faults"]
    assert rows[0]["back_at_own_pace_s"] is None
    assert rows[1]["back_at_own_pace_s"] == 2.2
