"""The goodput ledger's per-group state in numpy columns (monitor/goodput/columns.py) against the ledger
it replaced (tests/support/goodput_reference.py: the per-group dict-and-deque ledger, verbatim),
fed the same real views sweep after sweep: the same account of every sweep (SweepAccount, to
the bit), the same ``to_json()`` (the ``GET /v1/goodput`` document), snapshot and stored rows.

The job is random: groups joining and leaving, stalling, slow, restarting as a new incarnation
(out of the quorum meanwhile), evicted (by a finding's decision or by hand), ranks going dark,
world sizes and commit counts changing or odd, findings opening and clearing with fault strike
times, gaps longer than ``max_gap_s``, repeated sweeps, ``--expected-groups`` with slots never
seen, and both ledgers restarted from their stored state mid-run. Views come from a real
ViewBuilder with leader polling's pattern (a rank not asked keeps its RankView object), so the
columnar ledger's incremental reading is what is compared."""

from __future__ import annotations

import json
import random
from collections import deque

import numpy as np
import pytest

from monitor import goodput
from monitor.evidence.view import ViewBuilder
from monitor.goodput import CAUSES, GoodputConfig, GoodputLedger
from monitor.goodput.columns import History
from monitor.goodput.model import INTERVAL_FIELDS
from monitor.poll.discovery import Target
from monitor.poll.poller import RankPoll
from tests.support import goodput_reference as reference
from tests.support.monitor_sim import rank_state

T0 = 1_700_000_000.0


class RandomJob:
    def __init__(self, rng: random.Random, groups: int) -> None:
        self.rng = rng
        self.t = T0
        self.quorum = 2
        self.groups: dict[int, dict] = {}
        self.next_group = 0
        self.findings: list[dict] = []
        self.evictions: list[dict] = []
        self.next_id = 1
        self.builder = ViewBuilder()
        for _ in range(groups):
            self.join()

    def join(self) -> None:
        g = self.next_group
        self.next_group += 1
        size = self.rng.choice([1, 2, 3])
        self.groups[g] = {"rid": f"replica_group_{g}:0", "commits": 0, "in": True, "size": size,
                          "pace": 1.0, "down": set(), "odd": None, "struck": {},
                          "gws": size, "incarnation": 0, "out_for": 0}

    def targets(self) -> list[Target]:
        return [Target(f"http://127.0.0.1:{9000 + g * 10 + gr}", "static")
                for g, s in self.groups.items() for gr in range(s["size"])]

    def event(self, sweep_no: int) -> None:
        rng, groups = self.rng, self.groups
        g = rng.choice(list(groups))
        s = groups[g]
        e = rng.random()
        if e < 0.03 and len(groups) < 9:
            self.join()
        elif e < 0.05 and len(groups) > 2:
            del groups[g]  # its ranks are gone from the targets
        elif e < 0.10:  # a new incarnation, out of the quorum for a few sweeps
            s["incarnation"] += 1
            s.update(rid=f"replica_group_{g}:{s['incarnation']}", commits=0, out_for=3,
                     struck={})
            self.quorum += 1
        elif e < 0.16:
            s["pace"] = rng.choice([0.0, 0.3, 0.6, 1.0, 1.0])
        elif e < 0.20:
            s["down"] = {rng.randrange(s["size"])} if not s["down"] else set()
        elif e < 0.23:
            s["gws"] = rng.choice([s["size"], 4])
        elif e < 0.27:
            s["odd"] = rng.choice([None, -1, "7", 1.5, True])
        elif e < 0.33 and len(self.findings) < 3:  # a finding, with its fault's strike time
            kind = rng.choice(["straggler", "hang", "straggler"])
            onset = self.t - rng.uniform(0.0, 6.0)
            s["struck"] = {"slow_compute": onset}
            self.findings.append({
                "id": self.next_id, "kind": kind, "replica_group": g, "replica_id": s["rid"],
                "ranks": [g * 10 + s["size"] - 1], "first_seen": onset + 0.5,
                "confirmed_at": self.t, "evidence": {"culprit_ranks": [g * 10]}})
            self.next_id += 1
        elif e < 0.37 and self.findings:
            f = self.findings.pop(rng.randrange(len(self.findings)))
            if rng.random() < 0.6 and f["replica_group"] in groups:  # evicted: it restarts
                # confirmed at once: the reference ledger predates holding a sent kill's
                # recovery until it lands (tests/test_goodput.py checks that)
                self.evictions.append({
                    "id": self.next_id, "decision": "evict", "status": "confirmed", "at": self.t,
                    "finding_id": f["id"], "replica_group": f["replica_group"],
                    "replica_id": f["replica_id"], "source": "detector", "finding": f})
                self.next_id += 1
                gs = groups[f["replica_group"]]
                gs["incarnation"] += 1
                gs.update(rid=f"replica_group_{f['replica_group']}:{gs['incarnation']}",
                          commits=0, out_for=4, struck={}, pace=1.0)
        elif e < 0.38:  # by hand
            self.evictions.append({"id": self.next_id, "decision": "evict",
                                   "status": "confirmed", "at": self.t, "replica_group": g, "replica_id": s["rid"],
                                   "source": "manual"})
            self.next_id += 1
        self.evictions = self.evictions[-20:]

    def view(self, dt: float, sweep_no: int):
        self.t += dt
        polls, polled = {}, set()
        for g, s in self.groups.items():
            if s["out_for"]:
                s["out_for"] -= 1
            elif self.rng.random() < s["pace"]:
                s["commits"] += max(1, round(dt / 0.2 * s["pace"]))
            for gr in range(s["size"]):
                url = f"http://127.0.0.1:{9000 + g * 10 + gr}"
                if gr and self.rng.random() > 0.4 and sweep_no % 7:
                    continue  # a member not due: its last answer stays
                polled.add(url)
                if gr in s["down"]:
                    polls[url] = RankPoll(url, False, reason="connection", error="refused")
                    continue
                st = rank_state(g * 10 + gr, g, step=s["commits"], now=self.t,
                                quorum_id=self.quorum if not s["out_for"] else self.quorum - 1,
                                participants=len(self.groups))
                st.update(group_rank=gr, group_world_size=s["gws"], replica_id=s["rid"],
                          commits=s["commits"] if not (gr == 0 and s["odd"] is not None)
                          else s["odd"], participating=not s["out_for"],
                          faults_struck_at=s["struck"] if gr == s["size"] - 1 else {})
                polls[url] = RankPoll(url, True, data=st)
        return self.builder.update(self.targets(), polls, now=self.t, polled=polled)


def restarted(mod, cfg, state, incidents, intervals):
    """A ledger resumed from its stored rows, through JSON as the store keeps them."""
    state, incidents, intervals = json.loads(json.dumps([state, incidents, intervals]))
    return mod.GoodputLedger.restore(cfg, state, incidents, intervals)


RUN_LISTS = {"replica_group": "groups", "seconds": "seconds", "gpus": "gpus"}


def snapshot_rows(state: dict) -> dict:
    """A snapshot in the reference's form: per-group dicts, a totals dict per row and one
    unsettled slice per group of a run."""
    state = {**state, "unsettled": [
        {**{k: v for k, v in r.items() if k not in RUN_LISTS.values()},
         **dict(zip(RUN_LISTS, one, strict=True))}
        for r in state["unsettled"]
        for one in zip(*(r[f] for f in RUN_LISTS.values()), strict=True)]}
    g = state["groups"]
    window = g["window"]
    groups = {
        str(gid): {"replica_id": rid, "commits": c if c != -1 else None, "cum": cum,
                   "gpus": gpus or None, "last_in_quorum_at": at,
                   "history": [(t, row[j]) for t, row in list(zip(
                       window["t"], window["cum"], strict=True))[born:]], "carry": carry}
        for j, (gid, rid, c, cum, gpus, at, born, carry) in enumerate(zip(
            g["gid"], g["replica_id"], g["commits"], g["cum"], g["gpus"],
            g["last_in_quorum_at"], window["born"], g["carry"], strict=True))}
    iv = state["open_intervals"]
    open_intervals = {k: dict(zip(INTERVAL_FIELDS, row, strict=True))
                      for k, *row in zip(iv["key"], *(iv[f] for f in INTERVAL_FIELDS),
                                         strict=True)}
    state.pop("first_incident")  # where an older ledger's stored incidents end: not the reference's
    state.pop("quorum_top")  # a clamp of step-counted groups, which the reference has not
    return {**state, "version": 1, "groups": groups, "open_intervals": open_intervals,
            "totals": totals_rows(state["totals"]), "gpu_totals": totals_rows(state["gpu_totals"])}


def totals_rows(cols: dict) -> dict[str, dict[str, float]]:
    rows = {}
    for i, key in enumerate(cols["key"]):
        row = {c: cols[c][i] for c in CAUSES if c in cols and cols[c][i] is not None}
        row["goodput"], row["expected"] = cols["goodput"][i], cols["expected"][i]
        rows[key] = row
    return rows


def as_rows(led) -> dict:
    """A ledger's snapshot in the reference's form (the reference's is already, but for the
    version)."""
    state = led.snapshot()
    return snapshot_rows(state) if isinstance(led, GoodputLedger) else {**state, "version": 1}


def run(seed: int, sweeps: int, fixed_dt: float | None = None, **cfg
        ) -> tuple[GoodputLedger, dict]:
    rng = random.Random(seed)
    job = RandomJob(rng, rng.randint(2, 6))
    new_cfg, ref_cfg = GoodputConfig(**cfg), reference.GoodputConfig(**cfg)
    new, ref = GoodputLedger(new_cfg), reference.GoodputLedger(ref_cfg)
    stored: dict[str, list] = {"new": [[], []], "ref": [[], []]}
    covered = {"paced": 0, "startup": 0, "incidents": 0, "gaps": 0, "pending": 0}
    for n in range(sweeps):
        job.event(n)
        r = rng.random()
        dt = 40.0 if r < 0.01 or n == 50 else 0.0 if r < 0.02 else \
            fixed_dt or rng.uniform(0.2, 1.2)
        view = job.view(dt, n)
        findings = [dict(f) for f in job.findings]
        evictions = [dict(d) for d in job.evictions]
        a = new.update(view, findings, evictions, job.t)
        b = ref.update(view, findings, evictions, job.t)
        assert vars(a) == vars(b), (seed, n)  # two modules: two SweepAccount classes
        assert new.to_json() == ref.to_json(), (seed, n)
        assert as_rows(new) == as_rows(ref), (seed, n)
        assert new.unsaved() == ref.unsaved(), (seed, n)
        for led, key in ((new, "new"), (ref, "ref")):
            incs, ivs = led.unsaved()
            stored[key][0].extend(incs)
            stored[key][1].extend(ivs)
            led.saved()
        if n % 97 == 96:  # both monitors restart from what they stored
            new = restarted(goodput, new_cfg, new.snapshot(), *stored["new"])
            ref = restarted(reference, ref_cfg, ref.snapshot(), *stored["ref"])
            assert new.to_json() == ref.to_json(), (seed, n)
        covered["paced"] += new.baseline is not None
        covered["startup"] += new.baseline is None
        covered["incidents"] = len(new.incidents)
        covered["gaps"] = new.gaps
        covered["pending"] += any(r["cause"] == "pending" for r in new.snapshot()["unsettled"])
    return new, covered


@pytest.mark.parametrize("seed", [0, 1, 5, 13])
def test_columns_equal_the_per_group_ledger_over_random_sweeps(seed):
    cfg = {} if seed == 0 else {"baseline_min_samples": 3, "horizon_s": 6.0,
                                "pace_window_s": 1.5}
    if seed in (1, 13):
        cfg["expected_groups"] = 7
    # seed 13: a group out of the quorum at the first accounted sweep, then a 40 s gap: the
    # job's ratio sums its groups' totals in slot order, not in the order they were first booked
    # (120 sweeps hold that, a restart and the coverage below)
    # seed 5: sweeps 0.5 s apart (exact in binary), so a sample falls exactly on a pace
    # window's start (the "at or before" of _pace)
    led, covered = run(seed, 120 if seed == 13 else 200, fixed_dt=0.5 if seed == 5 else None,
                       **cfg)
    # the runs go through startup, paced sweeps, incidents, gaps and pending slow time (else
    # they would compare little)
    assert covered["paced"] > 100 and covered["startup"] > 0, covered
    assert covered["incidents"] and covered["gaps"] and covered["pending"], covered
    assert led.to_json()["job"]["goodput_seconds"] > 0


def test_a_new_incarnation_reads_its_ranks_not_asked_again():
    """A group's replica id changes while one of its ranks is not asked (its RankView object
    is last sweep's): that rank's count was of the old incarnation, and must not count for the
    new one. Both ledgers, by hand: 3 ranks, 50 commits; then a new incarnation on the two
    ranks asked, 1 commit."""
    vb = ViewBuilder()
    targets = [Target(f"http://127.0.0.1:{9000 + gr}", "static") for gr in range(3)]
    new, ref = GoodputLedger(), reference.GoodputLedger()

    def sweep(t: float, ranks: range, rid: str, commits: int) -> None:
        polls = {}
        for gr in ranks:
            st = rank_state(gr, 0, step=commits, now=t, quorum_id=2)
            st.update(group_rank=gr, group_world_size=3, replica_id=rid, commits=commits)
            polls[targets[gr].url] = RankPoll(targets[gr].url, True, data=st)
        view = vb.update(targets, polls, now=t, polled=set(polls))
        assert vars(new.update(view, [], [], t)) == vars(ref.update(view, [], [], t))
        assert new.to_json() == ref.to_json() and as_rows(new) == as_rows(ref)

    for i in range(4):
        sweep(T0 + i, range(3), "replica_group_0:a", 50 + i)
    sweep(T0 + 4, range(2), "replica_group_0:a", 54)  # rank 2 not asked (a copy: not fresh)
    sweep(T0 + 5, range(2), "replica_group_0:b", 1)  # rank 2 not asked: the same RankView
    sweep(T0 + 6, range(2), "replica_group_0:b", 2)
    assert as_rows(new)["groups"]["0"]["commits"] == 2


def test_the_shared_history_paces_each_group_as_its_own_deque_did():
    """``History.pace`` against ``_pace`` over each group's own trimmed deque: groups born at
    different sweeps, windows that fall exactly on a sample (a 0.5 s grid) and between."""
    rng = random.Random(3)
    hist = History()
    born, cum, own = [], [], []
    for n in range(60):
        t = T0 + 0.5 * n
        if n % 7 == 0:  # a group joins
            born.append(hist.next)
            cum.append(0)
            own.append(deque())
        cum = [c + rng.choice([0, 1, 1, 2]) for c in cum]
        window = rng.choice([1.0, 1.5, 2.0, 2.2, 3.0])
        hist.append(t, np.asarray(cum, np.int64), window)
        for h, c in zip(own, cum, strict=True):
            h.append((t, c))
            reference._trim(h, t, window)
        pace_window, b = rng.choice([0.5, 1.0, 1.5, 2.0, 2.3]), rng.choice([0.2, 0.25, 0.5])
        got = hist.pace(np.arange(len(cum)), np.asarray(born), pace_window, b)
        want = [reference._pace(h, pace_window, b) for h in own]
        assert [None if np.isnan(x) else x for x in got.tolist()] == want, n


def test_a_count_too_large_to_be_one_is_ignored_not_raised():
    """A rank claiming 2**53 commits or more (or as large a group) is not counted, as a
    negative count is not: the columns are int64 and a ledger that raised would stop
    accounting while that rank reports it."""
    vb = ViewBuilder()
    targets = [Target(f"http://127.0.0.1:{9000 + gr}", "static") for gr in range(2)]
    led = GoodputLedger()
    for i, huge in enumerate([0, 10**30, 2**53, 2**63]):
        polls = {}
        for gr in range(2):
            st = rank_state(gr, 0, step=10 + i, now=T0 + i, quorum_id=2)
            st.update(group_rank=gr, group_world_size=huge if gr and huge else 2,
                      commits=huge if gr and huge else 10 + i)
            polls[targets[gr].url] = RankPoll(targets[gr].url, True, data=st)
        led.update(vb.update(targets, polls, now=T0 + i, polled=set(polls)), [], [], T0 + i)
        group = as_rows(led)["groups"]["0"]
        assert (group["commits"], group["gpus"]) == (10 + i, 2), huge
