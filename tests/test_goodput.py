"""The goodput ledger (monitor/goodput/) fed synthetic sweeps: every cause, an incident's whole
life, a monitor restarted from a real SQLite store, skipped and missing sweeps, a group that never
returns, odd rank data. Each sweep's split is checked against the invariant
``goodput + badput + pending == expected groups x wall seconds``.

The job here is a model, not torchft: each group commits at a pace the test sets (steps of
``STEP`` seconds at pace 1.0), and the ledger sees it through /v1/state-shaped rank states in a
real :class:`monitor.evidence.view.ClusterView`."""

from __future__ import annotations

import math
import random
from dataclasses import asdict

import pytest

from monitor.evidence.view import RankView, ViewBuilder
from monitor.goodput import CAUSES, GoodputConfig, GoodputLedger
from monitor.poll.poller import RankPoll
from monitor.store import Store
from tests.support.views import job_ranks, scratch_view

STEP = 0.2  # healthy step time of the model job (s)
T0 = 1_700_000_000.0


class ModelJob:
    """Replica groups of ``gws`` ranks committing steps at a pace the test sets."""

    def __init__(self, groups: int = 3, gws: int = 2) -> None:
        self.t = T0
        self.gws = gws
        self.progress = 0.0  # the job's step, fractional
        self.groups = {g: {"rid": f"replica_group_{g}:a", "commits": 0, "in": True,
                           "joined": 0.0, "struck": {}, "phase": "forward", "reach": True}
                       for g in range(groups)}
        self.findings: list[dict] = []
        self.evictions: list[dict] = []
        self.splits: list[float] = []
        self.counted = dict.fromkeys(CAUSES, 0.0)  # badput the metrics counted (SweepAccount)
        self.counted_goodput = 0.0  # goodput the metrics counted (a counter: never negative)
        self.commit_times = False  # report ``last_step_at``, each newest step's commit time
        self.step_at: float | None = None

    def ranks(self) -> dict[str, RankView]:
        out = {}
        for g, s in self.groups.items():
            for gr in range(self.gws):
                url = f"http://127.0.0.1:{9000 + g * 10 + gr}"
                state = {"replica_group": g, "rank": g * self.gws + gr, "group_rank": gr,
                         "group_world_size": self.gws, "step": int(s["joined"]),
                         "quorum_id": 7 if s["in"] else 6, "phase": s["phase"],
                         "phase_since": self.t, "participating": s["in"],
                         "replica_id": s["rid"], "commits": s["commits"],
                         "faults_struck_at": s["struck"] if gr == 1 else {}}
                if self.commit_times:
                    state["last_step_at"] = self.step_at
                out[url] = RankView(url, s["reach"], state)
        return out

    def sweep(self, ledger: GoodputLedger, dt: float = 1.0, pace: float = 1.0):
        """Advance ``dt`` seconds at ``pace`` (every group in the quorum commits), then sweep."""
        before = self.progress
        self.t += dt
        self.progress += pace * dt / STEP
        n = int(self.progress) - int(before)
        if n:  # the newest step was crossed this long before the sweep
            self.step_at = self.t - (self.progress - int(self.progress)) * STEP / pace
        for s in self.groups.values():
            if s["in"]:
                s["commits"] += n
                s["joined"] = self.progress
        acct = ledger.update(scratch_view(self.t, ranks=self.ranks()), self.findings,
                             self.evictions, self.t)
        check_invariant(ledger)
        for c, v in acct.badput.items():
            self.counted[c] += v
        assert acct.goodput >= 0
        self.counted_goodput += acct.goodput
        return acct

    def run(self, ledger, seconds: float, pace: float = 1.0, dt: float = 1.0) -> None:
        for _ in range(int(round(seconds / dt))):
            self.sweep(ledger, dt, pace)

    def finding(self, kind, g, first_seen, confirmed_at, fid, ranks=None):
        f = {"id": fid, "kind": kind, "replica_group": g, "replica_id": self.groups[g]["rid"],
             "ranks": ranks or [g * self.gws + 1], "evidence": {}, "first_seen": first_seen,
             "confirmed_at": confirmed_at}
        self.findings.append(f)
        return f

    def evict(self, g, at, did, fid=None, source="auto"):
        self.evictions.append({"id": did, "decision": "evict", "replica_group": g,
                               "replica_id": self.groups[g]["rid"], "at": at, "finding_id": fid,
                               "status": "sent", "source": source, "finding": None})
        self.groups[g]["in"] = False

    def restart(self, g, suffix):
        s = self.groups[g]
        s.update(rid=f"replica_group_{g}:{suffix}", commits=0, **{"in": True}, struck={})


def check_invariant(ledger: GoodputLedger) -> None:
    j = ledger.to_json()["job"]
    total = j["goodput_seconds"] + sum(j["badput_seconds"].values()) + j["pending_seconds"]
    assert total == pytest.approx(j["expected_seconds"], abs=0.01), j
    for g in ledger.to_json()["groups"]:
        parts = g["goodput_seconds"] + sum(g["badput_seconds"].values()) + g["pending_seconds"]
        assert parts == pytest.approx(g["expected_seconds"], abs=0.01), g


def check_counted(job: ModelJob, ledger: GoodputLedger) -> None:
    """What the metrics counted, by cause == the settled badput plus the unsettled slices
    already counted (a slice whose cause changed after it was counted would break this)."""
    state = ledger.snapshot()
    for c in CAUSES:
        settled = sum(v for v in state["totals"].get(c, []) if v is not None)
        held = sum(sum(r["seconds"]) for r in state["unsettled"] if r["counted"] and r["cause"] == c)
        assert job.counted[c] == pytest.approx(settled + held, abs=1e-6), c


def save(store: Store, ledger: GoodputLedger) -> None:
    store.save_goodput(ledger.snapshot(), *ledger.unsaved())
    ledger.saved()


def job_json(ledger):
    return ledger.to_json()["job"]


def healthy_ledger(groups=3, seconds=20, **cfg):
    job = ModelJob(groups)
    led = GoodputLedger(GoodputConfig(**cfg))
    job.run(led, seconds)
    return job, led


def test_healthy_run_is_goodput_after_a_short_startup():
    job, led = healthy_ledger(seconds=60)
    out = led.to_json()
    j = out["job"]
    assert out["expected_groups"] == 3 and out["expected_groups_source"] == "max_seen"
    assert out["baseline"]["step_seconds"] == pytest.approx(STEP, rel=0.1)
    assert out["wall_seconds"] == 59  # the first sweep starts the ledger's clock
    assert j["expected_seconds"] == pytest.approx(3 * 59, abs=0.01)
    startup = j["badput_seconds"]["startup"]
    # a whole pace window (3 s) of commits, then 10 samples, one per sweep
    assert 3 * 11 <= startup <= 3 * 13
    assert j["goodput_seconds"] == pytest.approx(3 * 59 - startup, abs=0.01)
    assert {c: v for c, v in j["badput_seconds"].items() if v} == {"startup": startup}
    assert j["pending_seconds"] == 0 and out["incidents"] == [] and out["pace"]["ratio"] >= 0.9
    # GPU-seconds: the group world size (2) times replica-seconds
    assert j["gpu_seconds"]["goodput_seconds"] == pytest.approx(2 * j["goodput_seconds"])


def test_sweep_interval_longer_or_shorter_than_a_step_is_still_goodput():
    for dt in (0.07, 0.5, 2.5):  # commits per sweep: 0 or 1, 2-3, 12-13
        job = ModelJob(2)
        led = GoodputLedger()
        job.run(led, 30, dt=dt)
        j = job_json(led)
        assert j["goodput_seconds"] + j["badput_seconds"]["startup"] == pytest.approx(
            j["expected_seconds"], abs=0.01), (dt, j)


def test_straggler_incident_full_life():
    """Slow group 1 (pace 0.3 for everyone) -> straggler confirmed -> evicted -> survivors
    stall then back at pace -> group 1 restarted, heals, rejoins."""
    job, led = healthy_ledger(seconds=30)
    onset = job.t
    job.groups[1]["struck"] = {"slow_compute:delay=0.6": onset + 0.1}
    job.run(led, 8, pace=0.3)  # the detector's windows: slow, nothing explains it yet
    assert job_json(led)["pending_seconds"] == pytest.approx(3 * 8 * 0.7, rel=0.1)
    job.finding("straggler", 1, first_seen=onset + 4, confirmed_at=job.t, fid=11)
    job.run(led, 4, pace=0.3)
    j = job_json(led)
    assert j["pending_seconds"] == 0  # claimed back to the onset by the straggler
    check_counted(job, led)  # the claimed pending time reaches the metrics, as straggler drag
    assert j["badput_seconds"]["straggler_drag"] == pytest.approx(3 * 12 * 0.7, rel=0.1)
    job.evict(1, at=job.t - 0.2, did=5, fid=11)
    job.run(led, 4, pace=0.0)  # the Lighthouse has not dropped the killed group yet
    job.run(led, 10, pace=1.0)
    job.restart(1, "b")
    job.groups[1]["in"] = False  # restarting, then healing: out of the quorum
    job.run(led, 6, pace=1.0)
    job.groups[1]["in"] = True
    job.run(led, 10, pace=1.0)

    out = led.to_json()
    [inc] = out["incidents"]
    assert inc["kind"] == "straggler" and inc["finding_ids"] == [11] and inc["eviction_id"] == 5
    assert inc["onset_at"] == onset + 0.1 and inc["onset_source"] == "faults_struck_at"
    assert inc["detect_s"] == pytest.approx(8 - 0.1, abs=0.01)
    assert inc["evict_s"] == pytest.approx(12 - 0.3, abs=0.01)
    # back at pace: within a sweep of the survivors' first commit after the 4 s stall
    assert inc["back_to_pace_at"] - inc["evicted_at"] == pytest.approx(4.2, abs=1.01)
    assert inc["rejoined_at"] is not None and not inc["open"] and inc["closed_at"] is not None
    cost = inc["cost"]["by_cause"]
    assert cost["straggler_drag"] == pytest.approx(3 * 12 * 0.7, rel=0.1)
    # capacity: group 1 out from the eviction's sweep until it rejoined (4 + 10 + 6 sweeps)
    assert cost["capacity_lost"] == pytest.approx(20, abs=0.01)
    # recovery: the two survivors from the eviction until back at pace
    assert 2 * 4 <= cost["recovery"] <= 2 * 6
    assert set(cost) == {"straggler_drag", "capacity_lost", "recovery"}
    assert inc["cost"]["replica_seconds"] == pytest.approx(sum(cost.values()), abs=0.01)
    assert inc["cost"]["gpu_seconds"] == pytest.approx(2 * inc["cost"]["replica_seconds"],
                                                       abs=0.01)
    assert inc["gpus_per_group"] == 2
    # every badput interval after the onset is tied to it; capacity/recovery to the eviction
    ivs = [iv for iv in out["intervals"] if iv["cause"] != "startup"]
    assert ivs and all(iv["incident"] == inc["id"] for iv in ivs)
    assert {iv["cause"] for iv in ivs} == {"straggler_drag", "capacity_lost", "recovery"}
    assert all(iv["eviction_id"] == 5 for iv in ivs if iv["cause"] in ("capacity_lost",
                                                                      "recovery"))
    assert all(iv["finding_id"] == 11 for iv in ivs)
    # the group's own ledger: out of the quorum for 20 s
    g1 = next(g for g in out["groups"] if g["replica_group"] == 1)
    assert g1["badput_seconds"]["capacity_lost"] == pytest.approx(20, abs=0.01)
    # the baseline was frozen while the incident was open: still the healthy step
    assert out["baseline"]["step_seconds"] == pytest.approx(STEP, rel=0.1)


def test_hang_stall_is_tied_to_the_hang_back_to_its_first_evidence():
    job, led = healthy_ledger(seconds=30)
    hang_at = job.t
    job.run(led, 2, pace=0.0)  # shorter than the pace window: pending, not yet a stall
    assert job_json(led)["badput_seconds"]["stall"] == 0
    job.run(led, 3, pace=0.0)  # no commit for a whole window: a stall since the last commit
    j = job_json(led)
    assert j["pending_seconds"] == 0
    assert j["badput_seconds"]["stall"] == pytest.approx(3 * 5 - 3 * 0.3, abs=3 * 0.31)
    job.finding("hang", 2, first_seen=hang_at + 0.1, confirmed_at=job.t, fid=21)
    job.evict(2, at=job.t + 0.3, did=8, fid=21)
    job.run(led, 4, pace=0.0)
    job.groups[0]["in"] = False  # a survivor between quorums: part of the recovery
    job.sweep(led, pace=0.0)
    job.groups[0]["in"] = True
    job.run(led, 8, pace=1.0)
    g0 = [iv for iv in led.to_json()["intervals"] if iv["replica_group"] == 0
          and iv["start"] > hang_at + 4]
    assert g0 and all(iv["cause"] == "recovery" and iv["eviction_id"] == 8 for iv in g0)
    [inc] = led.to_json()["incidents"]
    assert inc["onset_source"] == "first_seen" and inc["onset_at"] == hang_at + 0.1
    cost = inc["cost"]["by_cause"]
    assert cost["stall"] == pytest.approx(j["badput_seconds"]["stall"], abs=0.01)
    assert cost["recovery"] == pytest.approx(2 * 5, abs=2 * 1.01)
    assert inc["recovery_s"] == pytest.approx(10, abs=1.5)
    assert inc["open"]  # group 2 has not come back: its capacity is still being lost


def test_hang_caught_within_a_window_claims_its_first_seconds_as_stall():
    """Detected and evicted before the job has been still for a whole pace window (4 s)."""
    job, led = healthy_ledger(seconds=30)
    hang_at = job.t
    job.run(led, 3, pace=0.0)
    assert job_json(led)["pending_seconds"] > 0
    job.finding("hang", 2, first_seen=hang_at + 0.2, confirmed_at=job.t, fid=4)
    job.evict(2, at=job.t, did=2, fid=4)
    job.run(led, 5, pace=0.0)  # the Lighthouse drops the killed group
    job.run(led, 8)
    out = led.to_json()
    assert out["job"]["pending_seconds"] == 0 and out["job"]["badput_seconds"]["unattributed"] == 0
    [inc] = out["incidents"]
    assert inc["cost"]["by_cause"]["stall"] == pytest.approx(out["job"]["badput_seconds"]["stall"])
    assert 3 * 2 <= inc["cost"]["by_cause"]["stall"] <= 3 * 3
    check_counted(job, led)
    assert inc["recovery_s"] == pytest.approx(8, abs=1.5)


@pytest.mark.parametrize("verdict", ["confirmed", "unconfirmed"])
def test_recovery_after_a_kill_is_counted_once_the_kill_is_judged(verdict):
    """A kill sent: the slow time after it is held uncounted as recovery. Confirmed (the group
    left), it is counted as recovery; unconfirmed (the group never left), the kill changed
    nothing and that time was the hang's stall all along."""
    job, led = healthy_ledger(seconds=30)
    hang_at = job.t
    job.run(led, 2, pace=0.0)
    job.finding("hang", 2, first_seen=hang_at + 0.1, confirmed_at=job.t, fid=4)
    job.evict(2, at=job.t, did=2, fid=4)
    job.groups[2]["in"] = True  # not seen to leave yet
    job.run(led, 6, pace=0.3)
    assert job_json(led)["badput_seconds"]["recovery"] > 0  # the ledger's provisional split
    assert job.counted["recovery"] == 0  # ... not yet counted by the metrics
    stall_before = job.counted["stall"]
    job.evictions[-1]["status"] = verdict
    job.sweep(led, pace=0.3)
    job.run(led, 10)
    check_counted(job, led)
    [inc] = led.to_json()["incidents"]
    if verdict == "confirmed":
        assert job.counted["recovery"] > 3 * 6 * 0.5
        assert inc["eviction_id"] == 2 and inc["cost"]["by_cause"]["recovery"] > 3 * 6 * 0.5
    else:
        assert job.counted["recovery"] == 0 and job_json(led)["badput_seconds"]["recovery"] == 0
        assert job.counted["stall"] - stall_before > 3 * 6 * 0.5
        assert inc["eviction_id"] is None and "recovery" not in inc["cost"]["by_cause"]


def test_idle_sweeps_while_a_held_incident_is_open_are_its_stall():
    """A mismatch the rails hold (no eviction): the job's idle sweeps are tied to it at once."""
    job, led = healthy_ledger(seconds=30)
    job.finding("mismatch", 2, first_seen=job.t, confirmed_at=job.t, fid=7)
    job.sweep(led)
    job.run(led, 2, pace=0.0)  # shorter than the pace window
    out = led.to_json()
    assert out["job"]["pending_seconds"] == 0
    [inc] = out["incidents"]
    assert inc["cost"]["by_cause"] == {"stall": pytest.approx(out["job"]["badput_seconds"]["stall"])}
    assert inc["cost"]["by_cause"]["stall"] > 3 * 1.5


def test_group_that_never_returns_keeps_losing_capacity_on_its_incident():
    job, led = healthy_ledger(seconds=30)
    job.evict(0, at=job.t + 0.5, did=3, source="manual")
    job.run(led, 60, pace=1.0)
    out = led.to_json()
    [inc] = out["incidents"]
    assert inc["kind"] == "manual" and inc["onset_source"] == "eviction"
    assert inc["back_to_pace_at"] is not None and inc["rejoined_at"] is None and inc["open"]
    assert inc["cost"]["by_cause"]["capacity_lost"] == pytest.approx(60, abs=0.01)
    g0 = next(g for g in out["groups"] if g["replica_group"] == 0)
    assert g0["badput_seconds"]["capacity_lost"] == pytest.approx(60, abs=0.01)
    assert out["job"]["goodput_ratio"] == pytest.approx(
        (out["job"]["goodput_seconds"]) / (3 * 89), abs=1e-3)
    # one group of three gone for 60 of the 89 s: at most 1 - 60 / (3 x 89) of the capacity
    assert out["job"]["goodput_ratio"] < 1 - 60 / (3 * 89)


def test_unexplained_slowness_settles_as_unattributed_and_the_baseline_adapts():
    job, led = healthy_ledger(seconds=60, horizon_s=10)  # a baseline of 40+ samples
    job.run(led, 8, pace=0.5)
    assert job_json(led)["pending_seconds"] > 0
    assert led.to_json()["baseline"]["frozen"]
    job.run(led, 90, pace=0.5)
    j = job_json(led)
    assert j["badput_seconds"]["unattributed"] > 3 * 10 * 0.5 * 0.9
    assert j["badput_seconds"]["straggler_drag"] == 0 and led.to_json()["incidents"] == []
    # after the horizon the new pace is adopted (a lasting change is the job's new normal)
    assert led.baseline == pytest.approx(2 * STEP, rel=0.15)


def test_late_straggler_cannot_claim_settled_time():
    job, led = healthy_ledger(seconds=20, horizon_s=5)
    onset = job.t
    job.run(led, 12, pace=0.4)
    job.finding("straggler", 0, first_seen=onset, confirmed_at=job.t, fid=1)
    job.sweep(led)
    j = job_json(led)
    assert j["badput_seconds"]["unattributed"] > 0  # older than the horizon: stays
    assert 0 < j["badput_seconds"]["straggler_drag"] < 3 * 12 * 0.6


def test_expected_groups_flag_counts_a_group_that_never_came():
    job = ModelJob(2)
    led = GoodputLedger(GoodputConfig(expected_groups=3))
    job.run(led, 30)
    out = led.to_json()
    assert out["expected_groups"] == 3 and out["expected_groups_source"] == "flag"
    unseen = next(g for g in out["groups"] if g["replica_group"] is None)
    startup = unseen["badput_seconds"]["startup"]
    assert unseen["badput_seconds"]["capacity_lost"] == pytest.approx(29 - startup, abs=0.01)
    assert out["job"]["expected_seconds"] == pytest.approx(3 * 29, abs=0.01)
    assert out["job"]["goodput_ratio"] < 2 / 3


def test_out_of_order_and_repeated_sweeps_are_skipped():
    job, led = healthy_ledger(seconds=20)
    before = led.to_json()["job"]
    view = scratch_view(job.t, ranks=job.ranks())
    assert not led.update(view, [], [], job.t).accounted  # the same time again
    assert not led.update(view, [], [], job.t - 5).accounted  # the clock went back
    assert led.to_json()["job"] == before and led.skipped_sweeps == 2
    job.sweep(led)  # and it carries on from where it was
    assert led.to_json()["job"]["expected_seconds"] == pytest.approx(
        before["expected_seconds"] + 3, abs=0.01)


def test_missing_sweeps_are_a_gap_credited_with_the_commits_made_across_it():
    job, led = healthy_ledger(seconds=20)
    before = led.to_json()["job"]
    job.sweep(led, dt=100, pace=0.5)  # the monitor was away; the job ran at half pace
    j = led.to_json()
    assert j["gaps"] == 1 and j["gap_seconds"] == 100
    gained = j["job"]["goodput_seconds"] - before["goodput_seconds"]
    assert gained == pytest.approx(3 * 50, rel=0.02)  # commits x baseline
    assert j["job"]["badput_seconds"]["unattributed"] == pytest.approx(3 * 100 - gained,
                                                                        abs=0.01)


def test_stopped_or_unreachable_job_is_not_accounted():
    job, led = healthy_ledger(seconds=20)
    for s in job.groups.values():
        s["phase"] = "stopped"
    job.run(led, 10, pace=0.0)
    for s in job.groups.values():
        s["reach"] = False
    job.run(led, 10, pace=0.0)
    out = led.to_json()
    assert out["unobserved_seconds"] == pytest.approx(20, abs=0.01)
    assert out["job"]["expected_seconds"] == pytest.approx(3 * 19, abs=0.01)


def test_odd_rank_values_are_ignored_not_raised():
    job, led = healthy_ledger(seconds=10)
    ranks = job.ranks()
    for i, r in enumerate(ranks.values()):
        r.state.update(commits=["x", -4, None, 1e9, True, "7"][i],
                       group_world_size="two", faults_struck_at={"x": "soon", "y": math.nan})
    job.t += 1
    led.update(scratch_view(job.t, ranks=ranks), [{"id": "nine", "kind": "hang"},
                                                     {"id": 4, "kind": "hang", "ranks": ["a"],
                                                      "replica_group": 1,
                                                      "first_seen": "then"}],
               [{"id": None}, {"id": 2, "decision": "evict", "at": "now"}], job.t)
    check_invariant(led)
    out = led.to_json()
    assert out["job"]["goodput_seconds"] <= out["job"]["expected_seconds"]
    assert {i["kind"] for i in out["incidents"]} <= {"hang", "manual"}


def test_restarted_monitor_resumes_totals_and_incidents_from_the_store(tmp_path):
    path = str(tmp_path / "monitor.sqlite")
    store = Store(path)
    job, led = healthy_ledger(seconds=30)
    job.finding("hang", 2, first_seen=job.t, confirmed_at=job.t + 3, fid=5)
    job.run(led, 4, pace=0.0)
    job.evict(2, at=job.t, did=9, fid=5)
    job.run(led, 5, pace=1.0)
    snap = led.snapshot()  # the open intervals as columns of dataclasses.asdict's fields
    cols = snap["open_intervals"]
    rows = [dict(zip(cols, row, strict=True)) for row in zip(*cols.values(), strict=True)]
    assert {r.pop("key"): r for r in rows} == {k: asdict(v) for k, v in led.open_intervals.items()}
    assert snap["open_intervals"]
    save(store, led)
    before = led.to_json()
    store.close()

    store = Store(path)  # a new monitor process, same --state
    state, incidents, intervals = store.load_goodput()
    resumed = GoodputLedger.restore(GoodputConfig(), state, incidents, intervals)
    assert resumed.to_json() == before
    job.findings = []  # the old finding was closed as monitor_restarted
    job.run(resumed, 5, pace=1.0)  # 5 s: a sweep gap shorter than max_gap is accounted
    after = resumed.to_json()
    assert after["job"]["expected_seconds"] == pytest.approx(
        before["job"]["expected_seconds"] + 3 * 5, abs=0.01)
    [inc] = after["incidents"]
    assert inc["id"] == before["incidents"][0]["id"] and inc["eviction_id"] == 9
    assert inc["cost"]["by_cause"]["capacity_lost"] == pytest.approx(
        before["incidents"][0]["cost"]["by_cause"]["capacity_lost"] + 5, abs=0.01)
    # the same fault confirmed again by the new monitor joins the same incident
    job.finding("hang", 2, first_seen=job.t, confirmed_at=job.t, fid=6)
    job.sweep(resumed)
    [inc] = resumed.to_json()["incidents"]
    assert inc["finding_ids"] == [5, 6]
    # settled intervals went to the store; a restart keeps them too
    save(store, resumed)
    assert all(iv["cause"] in CAUSES for iv in store.load_goodput()[2])
    store.close()


@pytest.mark.parametrize("restart_after", [None, 1, 2, 3])
def test_a_restart_just_after_the_job_resumed_dates_its_pace_as_without_it(tmp_path,
                                                                           restart_after):
    """The snapshot kept only the newest sample of the job's step history, so a monitor
    restarted within a pace window of the job's return dated it later: recovery_s grew by up
    to that window (20 s at 1 s steps), the headline figure of a fault."""
    job, led = ModelJob(3), GoodputLedger()
    job.run(led, 30)
    job.finding("hang", 2, first_seen=job.t + 0.1, confirmed_at=job.t + 2, fid=1)
    job.run(led, 2, pace=0.0)
    job.evict(2, at=job.t, did=1, fid=1)
    job.run(led, 3, pace=0.0)
    for i in range(30):  # the survivors at full pace from here
        if i == restart_after:  # the same --state, a sweep later
            store = Store(str(tmp_path / "m.sqlite"))
            save(store, led)
            store.close()
            store = Store(str(tmp_path / "m.sqlite"))
            led = GoodputLedger.restore(GoodputConfig(), *store.load_goodput())
            store.close()
            job.findings = []  # closed as monitor_restarted
        job.sweep(led)
    [inc] = led.to_json()["incidents"]
    assert inc["recovery_s"] == pytest.approx(5.9, abs=0.05)  # onset -> back at pace


def test_settled_intervals_are_persisted(tmp_path):
    store = Store(str(tmp_path / "m.sqlite"))
    job, led = healthy_ledger(seconds=20, horizon_s=5)
    job.evict(1, at=job.t, did=1, source="manual")
    job.run(led, 30)
    save(store, led)
    job.restart(1, "b")
    job.run(led, 10)
    save(store, led)
    _, _, rows = store.load_goodput()
    cap = [r for r in rows if r["cause"] == "capacity_lost"]
    assert cap and all(r["eviction_id"] == 1 and r["replica_group"] == 1 for r in cap)
    assert sum(r["replica_seconds"] for r in cap) == pytest.approx(30, abs=1.01)
    state, incidents, _ = store.load_goodput()
    assert state["version"] == 3 and incidents[0]["closed_at"] is not None
    store.close()


def test_dashboard_colours_every_badput_cause():
    from dashboards.build import BADPUT_COLORS

    assert list(BADPUT_COLORS) == ["startup", "capacity_lost", "recovery", "stall",
                                   "straggler_drag", "unattributed"]
    assert set(BADPUT_COLORS) == set(CAUSES)


def test_a_group_still_launching_is_startup_until_it_first_joins():
    job = ModelJob(3)
    job.groups[2]["in"] = False  # answers, not yet in the quorum (first quorum, healing)
    led = GoodputLedger()
    job.run(led, 20)
    g2 = next(g for g in led.to_json()["groups"] if g["replica_group"] == 2)
    assert g2["badput_seconds"]["startup"] == pytest.approx(19, abs=0.01)
    job.groups[2]["in"] = True
    job.run(led, 10)
    g2 = next(g for g in led.to_json()["groups"] if g["replica_group"] == 2)
    assert g2["badput_seconds"]["capacity_lost"] == 0
    assert g2["goodput_seconds"] >= 9


def test_a_lasting_straggler_never_becomes_the_baseline():
    """Not evicted (dry run): the straggler's pace must not become the healthy pace."""
    job, led = healthy_ledger(seconds=60)
    job.finding("straggler", 1, first_seen=job.t, confirmed_at=job.t + 1, fid=3)
    job.run(led, 150, pace=0.3)
    out = led.to_json()
    assert out["baseline"]["step_seconds"] == pytest.approx(STEP, rel=0.1)
    assert out["baseline"]["frozen"] == "incident 1 open"
    drag = out["job"]["badput_seconds"]["straggler_drag"]
    assert drag == pytest.approx(3 * 150 * 0.7, rel=0.05)
    [inc] = out["incidents"]
    assert inc["open"] and inc["back_to_pace_at"] is None and inc["recovery_s"] is None


def test_expected_groups_flag(capsys):
    import argparse

    from monitor.cli import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args(["--expected-groups", "4"])).expected_groups == 4
    assert config_from_args(p.parse_args([])).expected_groups is None
    for bad in ("0", "three"):
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--expected-groups", bad])
        assert e.value.code == 2
        assert "--expected-groups" in capsys.readouterr().err


def test_stall_during_an_open_straggler_belongs_to_the_hang_from_its_onset():
    """A straggler confirmed but never acted on (dry run), then a hang stops every group: the
    idle sweeps after the hang's onset are the hang's stall (not straggler drag), from the onset,
    also those before the hang was confirmed (claimed back)."""
    job, led = healthy_ledger(seconds=30)
    job.groups[1]["struck"] = {"slow_compute:delay=0.6": job.t}
    job.finding("straggler", 1, first_seen=job.t, confirmed_at=job.t, fid=1)
    job.run(led, 10, pace=0.4)
    hang_at = job.t
    job.run(led, 2, pace=0.0)  # shorter than the pace window (4 s): not a stall by itself
    job.finding("hang", 2, first_seen=hang_at + 0.1, confirmed_at=job.t, fid=2)
    job.run(led, 3, pace=0.0)
    out = led.to_json()
    hang = next(i for i in out["incidents"] if i["kind"] == "hang")
    strag = next(i for i in out["incidents"] if i["kind"] == "straggler")
    tied = [iv for iv in out["intervals"] if iv["incident"] == hang["id"]]
    assert tied and min(iv["start"] for iv in tied) == pytest.approx(hang_at, abs=1e-6)
    assert {iv["cause"] for iv in tied} == {"stall"}
    assert hang["cost"]["by_cause"]["stall"] == pytest.approx(3 * 5, abs=0.01)
    # no straggler drag after the hang's onset
    assert all(iv["end"] <= hang_at + 1e-6 for iv in out["intervals"]
               if iv["incident"] == strag["id"])
    assert out["job"]["pending_seconds"] == 0
    check_counted(job, led)  # the metrics count the claimed seconds as stall, once


def test_a_group_named_as_the_cause_of_a_job_stall_takes_over_its_incident():
    """A partition: every group stalls alike, so the monitor first confirms a job-wide stall
    (no group); seconds later the probes name host 0's network, a ``network`` finding on group 0
    that lists the job-wide finding it explains. One fault, one incident: group 0's, whose cost
    and recovery count from the stall's onset, not from when the host was named."""
    job, led = healthy_ledger(seconds=30)
    stall_at = job.t
    job.run(led, 2, pace=0.0)
    job.findings.append({"id": 1, "kind": "job_stall", "replica_group": None,
                         "replica_id": None, "ranks": [], "evidence": {},
                         "first_seen": stall_at + 0.1, "confirmed_at": job.t})
    job.run(led, 3, pace=0.0)
    named_at = job.t
    f = job.finding("network", 0, first_seen=named_at - 1.5, confirmed_at=named_at, fid=2,
                    ranks=[0, 1])
    f["evidence"] = {"host": "node-0", "job_findings": ["job_stall"]}
    job.evict(0, at=named_at + 0.2, did=5, fid=2)
    job.run(led, 3, pace=0.0)
    job.restart(0, "b")
    job.run(led, 10)
    out = led.to_json()
    [inc] = out["incidents"]
    assert (inc["kind"], inc["replica_group"], inc["ranks"]) == ("network", 0, [0, 1])
    assert inc["onset_source"] == "job_wide" and inc["onset_at"] == stall_at + 0.1
    assert inc["detected_at"] == named_at and inc["eviction_id"] == 5
    assert inc["cost"]["by_cause"]["stall"] == pytest.approx(
        out["job"]["badput_seconds"]["stall"], abs=0.01)
    assert inc["cost"]["by_cause"]["stall"] >= 3 * 5
    assert inc["recovery_s"] > named_at - stall_at
    check_counted(job, led)


def test_onset_is_the_strike_the_evidence_began_with_not_a_later_one():
    """The straggler's first_seen is its first late step's start, which its strike follows by
    a fraction of a step: that strike is the onset. A second fault of the same rank, struck
    after the evidence began, is not its cause."""
    job, led = healthy_ledger(seconds=30)
    t = job.t
    job.groups[1]["struck"] = {"slow_compute:delay=0.6": t + 0.3,
                               "slow_compute:delay=0.9": t + 4.0}
    job.finding("straggler", 1, first_seen=t, confirmed_at=t + 5, fid=1)
    job.run(led, 6, pace=0.5)
    [inc] = led.to_json()["incidents"]
    assert (inc["onset_source"], inc["onset_at"]) == ("faults_struck_at", t + 0.3)


def test_a_group_finding_that_explains_no_job_stall_opens_its_own_incident():
    job, led = healthy_ledger(seconds=30)
    job.findings.append({"id": 1, "kind": "job_slow", "replica_group": None,
                         "replica_id": None, "ranks": [], "evidence": {},
                         "first_seen": job.t, "confirmed_at": job.t})
    job.run(led, 2, pace=0.5)
    job.finding("hang", 2, first_seen=job.t, confirmed_at=job.t, fid=2)
    job.sweep(led, pace=0.0)
    assert sorted((i["kind"], i["replica_group"]) for i in led.to_json()["incidents"]) == [
        ("hang", 2), ("job_slow", None)]


def test_idle_sweeps_under_a_lone_straggler_stay_its_drag():
    """No other fault: the straggler's idle sweeps (its slow steps) settle as its drag once the
    job commits again."""
    job, led = healthy_ledger(seconds=30)
    job.finding("straggler", 1, first_seen=job.t, confirmed_at=job.t, fid=1)
    for _ in range(4):
        job.run(led, 2, pace=0.0)  # a 2 s step: idle sweeps, shorter than the window
        job.run(led, 1, pace=1.0)
    out = led.to_json()
    [inc] = out["incidents"]
    assert set(inc["cost"]["by_cause"]) == {"straggler_drag"}
    assert out["job"]["badput_seconds"]["stall"] == 0 and out["job"]["pending_seconds"] == 0
    assert not any(s["cause"] == "straggler_drag"
                   for s in led.snapshot()["unsettled"])  # settled
    check_counted(job, led)


def _evicted_straggler(horizon_s=10.0):
    job, led = healthy_ledger(seconds=30, horizon_s=horizon_s)
    job.finding("straggler", 1, first_seen=job.t, confirmed_at=job.t, fid=1)
    job.run(led, 3, pace=0.4)
    job.findings.clear()
    job.evict(1, at=job.t, did=1, fid=1)
    return job, led


def test_job_steady_below_the_frozen_baseline_settles_the_incident_and_moves_the_baseline():
    """After the eviction the job runs steadily at 0.8x the old pace (a slower machine, slower
    survivors): the incident closes as settled at 0.8x, the baseline follows, later time is
    goodput again instead of recovery forever."""
    job, led = _evicted_straggler()
    evicted_at = job.t
    job.run(led, 2, pace=0.0)
    job.restart(1, "b")
    job.run(led, 30, pace=0.8)
    out = led.to_json()
    [inc] = out["incidents"]
    assert inc["back_to_pace"] == "settled" and inc["settled_pace"] == pytest.approx(0.8, abs=0.05)
    assert inc["settled_step_s"] == pytest.approx(STEP / 0.8, rel=0.05)
    # the steady period began one window after the survivors resumed (W = 4 s)
    assert evicted_at + 2 <= inc["back_to_pace_at"] <= evicted_at + 2 + 4 + 1
    assert not inc["open"] and inc["recovery_s"] is not None
    assert led.baseline == pytest.approx(STEP / 0.8, rel=0.05)
    assert out["baseline"]["frozen"] is None
    recovery = out["job"]["badput_seconds"]["recovery"]
    job.run(led, 20, pace=0.8)
    out = led.to_json()
    assert out["job"]["badput_seconds"]["recovery"] == pytest.approx(recovery)
    assert out["job"]["pending_seconds"] == 0 and out["job"]["badput_seconds"]["unattributed"] == 0
    assert out["pace"]["ratio"] >= 0.9


def test_settling_needs_a_steady_pace_and_no_open_finding():
    job, led = _evicted_straggler()
    job.restart(1, "b")
    for _ in range(8):  # pace swinging between 0.5 and 0.8 every 4 s: never steady
        job.run(led, 4, pace=0.5)
        job.run(led, 4, pace=0.8)
    [inc] = led.to_json()["incidents"]
    assert inc["back_to_pace_at"] is None and inc["open"] and led.baseline == pytest.approx(
        STEP, rel=0.1)
    # steady now, but a confirmed finding is open (the killed incarnation's, joining the
    # incident: a new incident would end the recovery instead): not settled either
    job.findings.append({"id": 9, "kind": "dead", "replica_group": 1,
                         "replica_id": "replica_group_1:a", "ranks": [3], "evidence": {},
                         "first_seen": job.t, "confirmed_at": job.t})
    job.run(led, 30, pace=0.8)
    inc = next(i for i in led.to_json()["incidents"] if i["id"] == inc["id"])
    assert inc["back_to_pace_at"] is None
    job.findings.clear()
    job.run(led, 20, pace=0.8)
    inc = next(i for i in led.to_json()["incidents"] if i["id"] == inc["id"])
    assert inc["back_to_pace"] == "settled"


def test_back_at_pace_is_dated_from_the_first_commit_by_the_ranks_clock():
    """Survivors stalled after an eviction commit again between two sweeps: the job is back
    at pace from that commit (the ranks' ``last_step_at``), not from either sweep around it."""
    job, led = healthy_ledger(seconds=30)
    job.commit_times = True
    job.finding("hang", 2, first_seen=job.t, confirmed_at=job.t, fid=1)
    job.run(led, 1, pace=0.0)
    job.evict(2, at=job.t, did=1, fid=1)
    job.run(led, 2.3, pace=0.0, dt=0.1)  # the survivors' quorum forms without group 2 ...
    job.progress = float(int(job.progress)) + 0.5  # ... half a step into the next one
    job.sweep(led, dt=0.1, pace=0.0)
    resumed = job.t  # the next step ends 0.5 x STEP (0.1 s) after this sweep, 0.05 s before
    job.run(led, 10, pace=1.0, dt=0.15)  # the next, which sees it
    [inc] = led.to_json()["incidents"]
    assert inc["back_to_pace"] == "reached"
    assert inc["back_to_pace_at"] == pytest.approx(resumed + 0.5 * STEP, abs=1e-6)


@pytest.mark.parametrize("bad", ["soon", float("nan"), float("inf"), True, None, [1.0]])
def test_a_step_time_that_is_not_a_finite_number_is_not_read(bad):
    """A rank's ``last_step_at`` is its claim: one that is no time, or of an older step, is
    left out; the group's step time is then its other rank's, or none."""
    job = ModelJob(groups=1)
    ranks = job.ranks()
    a, b = ranks.values()
    a.state.update(step=5, last_step_at=bad)
    b.state.update(step=5, last_step_at=T0 + 1.5)
    assert scratch_view(T0 + 2, ranks).groups[0].step_at == T0 + 1.5
    b.state.update(step=4, last_step_at=T0 + 1.8)  # an older step's time is not the newest's
    assert scratch_view(T0 + 2, ranks).groups[0].step_at is None


def test_job_back_at_pace_is_reached_not_settled():
    job, led = _evicted_straggler()
    job.restart(1, "b")
    job.run(led, 20, pace=1.0)
    [inc] = led.to_json()["incidents"]
    assert inc["back_to_pace"] == "reached" and inc["settled_pace"] is None
    assert led.baseline == pytest.approx(STEP, rel=0.1)


def test_straggler_drag_starts_at_the_onset_not_when_the_window_notices():
    """A straggler at 0.6x pace: the trailing window W (4 s here) still holds the healthy
    commits from before the strike, so the first sweeps after it look at pace. Once the
    straggler is confirmed they are judged again from its onset: slow, its drag from the strike
    on (before, the drag began ~1 s late, when W's pace fell below 0.9). Goodput the metrics'
    counter already had is paid back from later sweeps, never counted negative."""
    job, led = healthy_ledger(seconds=30)
    onset = job.t + 0.1
    job.groups[1]["struck"] = {"slow_compute:delay=0.3": onset}
    job.run(led, 1.0, pace=0.6, dt=0.5)  # W's pace still >= 0.9: credited whole, for now
    assert job_json(led)["pending_seconds"] == 0
    good_before = job_json(led)["goodput_seconds"]
    job.finding("straggler", 1, first_seen=onset + 0.4, confirmed_at=job.t, fid=31)
    job.run(led, 3.0, pace=0.6, dt=0.5)
    out = led.to_json()
    [inc] = out["incidents"]
    assert inc["onset_at"] == onset
    tied = [iv for iv in out["intervals"] if iv["incident"] == inc["id"]]
    assert min(iv["start"] for iv in tied) == pytest.approx(onset, abs=1e-3)
    assert {iv["cause"] for iv in tied} == {"straggler_drag"}
    # every slot at 0.6x from the strike: 40% of its time is the straggler's drag
    drag = out["job"]["badput_seconds"]["straggler_drag"]
    assert drag == pytest.approx(3 * (job.t - onset) * 0.4, rel=0.1)
    assert job_json(led)["goodput_seconds"] < good_before + 3 * 3.0 * 0.7
    check_counted(job, led)
    assert job.counted_goodput + led.goodput_debt == pytest.approx(
        out["job"]["goodput_seconds"], abs=1e-6)


def test_a_fault_that_does_not_slow_the_job_is_not_rejudged():
    """Judging again from the onset books nothing when the job kept its pace (a mismatch)."""
    job, led = healthy_ledger(seconds=30)
    onset = job.t + 0.1
    job.run(led, 2.0, dt=0.5)
    job.finding("mismatch", 2, first_seen=onset, confirmed_at=job.t, fid=41)
    job.run(led, 2.0, dt=0.5)
    out = led.to_json()
    assert out["job"]["goodput_ratio"] == pytest.approx(
        job_json(healthy_ledger(seconds=34)[1])["goodput_ratio"], abs=0.02)
    assert not [iv for iv in out["intervals"] if iv["incident"] is not None
                and iv["start"] < job.t - 2.0 + 1e-6]


def test_slow_commits_are_credited_whole_across_sweeps_shorter_than_a_step():
    """Below pace a group is credited b per commit. With sweeps shorter than a step (0.1 s
    sweeps, 0.2 s steps) a commit holds more than its sweep: the rest is carried to the next
    sweep, so a group at 0.8x pace keeps 0.8 of its time (capped per sweep, it kept 0.4)."""
    job, led = healthy_ledger(seconds=30)
    job.run(led, 3.0, pace=0.8, dt=0.1)  # W's pace still >= 0.9 for the first ~2 s
    before = job_json(led)["goodput_seconds"]
    job.run(led, 3.0, pace=0.8, dt=0.1)
    gained = job_json(led)["goodput_seconds"] - before
    assert gained == pytest.approx(3 * 3.0 * 0.8, rel=0.08)


def test_a_ledger_over_incremental_views_equals_one_over_views_built_afresh():
    """Leader polling over an incremental view (a rank not asked is the RankView object read
    last sweep, which the ledger does not read again) against the same sweeps as views of
    copied ranks read afresh: the same accounts, totals, incidents and snapshot, through
    slow groups, restarts, ranks going dark, a world size change and odd commit values."""
    rng = random.Random(9)
    groups, size = 5, 3
    targets, states = job_ranks(groups, size, T0, commits=0)
    vb = ViewBuilder()
    inc, ref = GoodputLedger(GoodputConfig()), GoodputLedger(GoodputConfig())
    now, down = T0, set()
    for sweep_no in range(120):
        now += 1.0
        for g in range(groups):
            done = rng.choice([0, 1, 2, 2, 2]) if g != sweep_no % groups else 0
            for r in range(g * size, (g + 1) * size):
                states[r]["commits"] += done
                states[r]["step"] += done
        event = rng.random()
        if event < 0.05:  # a group restarts: a new incarnation from zero commits
            g = rng.randrange(groups)
            for r in range(g * size, (g + 1) * size):
                states[r].update(replica_id=f"replica_group_{g}:{sweep_no}", commits=0)
        elif event < 0.12:  # a leader goes dark (its members' commits count then) or back
            down = {rng.randrange(groups) * size} if not down else set()
        elif event < 0.15:  # a group's members say another world size (the majority's counts)
            g, n = rng.randrange(groups), rng.choice([size, 4])
            for r in range(g * size + 1, (g + 1) * size):
                states[r]["group_world_size"] = n
        # now and then a leader's answer carries an odd commit count: its members' count
        odd = {rng.randrange(groups) * size: rng.choice([-1, "7", None, 1.5])} \
            if event > 0.5 else {}
        polled = {t.url for r, t in enumerate(targets)
                  if rng.random() < (0.9 if r % size == 0 else 0.4)}
        polls = {t.url: (RankPoll(t.url, True, data={**states[r], **(
                             {"commits": odd[r]} if r in odd else {})}) if r not in down
                         else RankPoll(t.url, False, reason="connection", error="refused"))
                 for r, t in enumerate(targets) if t.url in polled}
        view = vb.update(targets, polls, now=now, polled=polled)
        scratch = scratch_view(now, ranks={u: r.copy() for u, r in view.ranks.items()},
                              polled=view.polled)
        ref._read = None  # the reference reads every rank afresh
        assert inc.update(view, [], [], now) == ref.update(scratch, [], [], now), sweep_no
        assert inc.to_json() == ref.to_json(), sweep_no
        assert inc.snapshot() == ref.snapshot(), sweep_no
    assert ref.to_json()["job"]["goodput_seconds"] > 0
