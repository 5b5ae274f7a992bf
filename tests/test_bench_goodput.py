"""benchmarks/bench_goodput.py's pure functions: the ground truth it reads from the ranks' logs,
goodput by the ledger's definitions on commit times, and the reconciliation with the ledger.
Plain data, no processes (the benchmark itself is run by hand: docs/goodput.md, Benchmark)."""

from __future__ import annotations

import time

import pytest

from benchmarks.bench_goodput import (
    back_at_pace,
    badput_by_window,
    badput_in_window,
    fault_cuts,
    goodput_from_commits,
    healthy_step_s,
    job_commit_times,
    ledger_window,
    parse_commit_log,
    reconcile,
    vs_fault_free,
)

B = 0.25  # healthy step time of the synthetic job


def steady(t0: float, t1: float, b: float = B) -> list[float]:
    n = int((t1 - t0) / b)
    return [t0 + (i + 1) * b for i in range(n)]


def log_line(unix: float, step: int, committed: bool = True) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))
    ms = int(round((unix % 1) * 1000))
    return (f"{stamp},{ms:03d} lightkeeper.trainer INFO step={step} quorum_id=2 participants=3 "
            f"step_time=0.150s committed={committed} loss=5.6641")


def test_parse_commit_log_counts_each_step_once_at_its_first_rank():
    t = 1_800_000_000.0
    text = "\n".join([
        log_line(t + 0.1, 5), log_line(t + 0.3, 5),           # both ranks log step 5
        log_line(t + 0.5, 6, committed=False),                 # not committed: not a commit
        "garbage " + log_line(t + 0.6, 7),                     # another process ran into it
        log_line(t + 0.9, 7), "torchrun noise",
    ])
    got = parse_commit_log(text)
    assert [s for _, s in got] == [5, 7]
    assert got[0][0] == pytest.approx(t + 0.1, abs=2e-3)
    assert got[1][0] == pytest.approx(t + 0.9, abs=2e-3)


def test_healthy_job_is_all_goodput_and_a_missing_group_loses_its_slot():
    commits = {g: steady(0, 40) for g in range(3)}
    assert healthy_step_s(commits, 0, 40) == pytest.approx(B)
    gp = goodput_from_commits(commits, 10, 30, B, 3)
    assert gp["expected_s"] == pytest.approx(60)
    assert gp["ratio"] == pytest.approx(1.0, abs=0.01)
    # group 2 gone from t=20: its slot is badput from then on (after its window drains)
    commits[2] = steady(0, 20)
    gp = goodput_from_commits(commits, 10, 30, B, 3)
    assert gp["ratio"] == pytest.approx((60 - 10) / 60, abs=0.02)
    # a slot never seen at all counts too (expected groups, not seen groups)
    gp = goodput_from_commits({0: steady(0, 40), 1: steady(0, 40)}, 10, 30, B, 3)
    assert gp["ratio"] == pytest.approx(2 / 3, abs=0.01)


def test_a_group_at_half_pace_counts_only_what_its_commits_take_at_healthy_pace():
    commits = {0: steady(0, 40), 1: steady(0, 40), 2: steady(0, 40, 2 * B)}
    gp = goodput_from_commits(commits, 10, 30, B, 3)
    assert gp["ratio"] == pytest.approx((20 + 20 + 10) / 60, abs=0.02)


def test_bad_window_or_baseline_is_a_clear_error():
    with pytest.raises(ValueError, match="empty window"):
        goodput_from_commits({0: [1.0]}, 5, 5, B, 1)
    with pytest.raises(ValueError, match="baseline"):
        goodput_from_commits({0: [1.0]}, 0, 5, 0.0, 1)
    assert healthy_step_s({0: [1.0, 2.0]}, 0, 5) is None  # too few gaps for a median


def test_badput_falls_in_the_window_of_the_fault_that_preceded_it():
    bins = [[0, 1, 3.0], [1, 2, 2.0], [2, 3, 1.0], [3, 4, 3.0]]
    got = badput_by_window(bins, 3, [(2.0, "hang (group 2)"), (0.5, "slow (group 1)")])
    assert got == {"before faults": 0.0, "slow (group 1)": 1.0, "hang (group 2)": 2.0}


def test_back_at_pace_after_a_stall():
    # the job commits steadily, stalls from 10 to 20 s, then resumes at full pace
    job = steady(0, 10) + [20 + t for t in steady(0, 20)]
    back = back_at_pace(job, 12.0, 40.0, B)
    assert back == pytest.approx(20 + B)  # the first commit after the stall
    assert back_at_pace(job, 12.0, 24.0, B) is None  # no whole window at pace by the end
    # a job at half pace is never back
    assert back_at_pace(steady(0, 40, 2 * B), 5.0, 40.0, B) is None


def test_job_commit_times_follow_the_newest_step_only():
    steps = {0: [(1.0, 1), (2.0, 2), (3.0, 3)], 1: [(1.1, 1), (2.5, 2), (9.0, 3)],
             2: [(8.0, 2)]}  # group 2 healed to step 2 late: not a job step
    assert job_commit_times(steps) == [2.0, 3.0]


def ledger_of(commits, t0, t1, b, groups, **extra):
    gp = goodput_from_commits(commits, t0, t1, b, groups)
    before = {"at": t0, "job": {"goodput_seconds": 100.0, "expected_seconds": 150.0,
                                "badput_seconds": {"stall": 1.0}}}
    after = {"at": t1, "baseline": {"step_seconds": b},
             "job": {"goodput_seconds": 100.0 + gp["goodput_s"] + extra.get("extra_good", 0),
                     "expected_seconds": 150.0 + gp["expected_s"],
                     "badput_seconds": {"stall": 1.0 + gp["expected_s"] - gp["goodput_s"]},
                     "pending_seconds": 0.0}}
    return ledger_window(before, after)


def test_reconcile_agrees_with_a_ledger_that_matches_the_ground_truth_and_fails_otherwise():
    # group 2 hangs at 20 s; evicted at 22 s; the survivors go on from 27 s at full pace
    commits = {g: steady(0, 20) + [27 + t for t in steady(0, 33)] for g in (0, 1)}
    commits[2] = steady(0, 20)
    steps = {g: [(t, i + 1) for i, t in enumerate(times)] for g, times in commits.items()}
    jt = job_commit_times(steps)
    led = ledger_of(commits, 5, 60, B, 3)
    assert led["ratio"] is not None and led["badput_s"]["stall"] > 0
    back = back_at_pace(jt, 22.0, 60, B)
    inc = {"id": 1, "kind": "hang", "replica_group": 2, "onset_at": 20.05, "detected_at": 21.5,
           "evicted_at": 22.0, "back_to_pace_at": back, "recovery_s": back - 20.05}
    ivs = [{"incident": 1, "start": 20.0, "end": 27.0}, {"incident": None, "start": 3.0}]
    strikes = [{"replica_group": 2, "kind": "hang", "at": 20.0}]
    checks = reconcile(commits, jt, led, [inc], ivs, strikes, 3)
    assert [c["ok"] for c in checks] == [True, True, True, True], checks

    # a ledger that counted 10% more goodput, an onset 2 s late, intervals 3 s early: all fail
    led_bad = ledger_of(commits, 5, 60, B, 3, extra_good=0.1 * 165)
    late = {**inc, "onset_at": 22.0}
    early = [{"incident": 1, "start": 17.0}]
    checks = reconcile(commits, jt, led_bad, [late], early, strikes, 3)
    by = {c["check"].split(": ")[-1]: c["ok"] for c in checks}
    assert by["goodput ratio over the ledger's window"] is False
    assert by["onset vs the rank's strike"] is False
    assert by["first badput interval vs the strike"] is False
    # a fault the ledger has no incident for fails its check
    checks = reconcile(commits, jt, led, [], ivs, strikes, 3)
    assert checks[-1] == {"check": "hang in group 2: an incident", "ok": False,
                          "note": "no incident for this group in the ledger"}


def test_recomputed_goodput_uses_the_baseline_the_ledger_had_at_each_moment():
    """A job that speeds up as the load on its machine falls (step 0.3 s, then 0.2 s): the
    ledger's baseline follows it, every bin at its pace. Judged throughout with the final
    baseline (the old recomputation) the slower first half looks slow."""
    first = steady(0, 30, 0.3)
    commits = {g: first + [30 + t for t in steady(0, 30, 0.2)] for g in range(3)}
    follow = [(0.0, 0.3), (30.0 + 4.0, 0.2)]  # the ledger's median moves a few s after
    with_history = goodput_from_commits(commits, 5, 60, 0.2, 3, baselines=follow)
    assert with_history["ratio"] == pytest.approx(1.0, abs=0.03)
    final_only = goodput_from_commits(commits, 5, 60, 0.2, 3)
    assert final_only["ratio"] == pytest.approx((25 * 0.2 / 0.3 + 30) / 55, abs=0.02)


def test_a_fault_cuts_the_pace_window_at_its_onset():
    """Group pace halves at 20 s: the window W (20 x 0.25 = 5 s) still holds the commits
    before it, so without the cut the first bins after the strike count whole; cut at the
    onset, each counts its own commits x b from the strike on (until the fault is acted on)."""
    slow = steady(0, 20) + [20 + t for t in steady(0, 20, 2 * B)]
    commits = {0: slow, 1: slow, 2: slow}
    no_cut = goodput_from_commits(commits, 10, 30, B, 3)
    cut = goodput_from_commits(commits, 10, 30, B, 3, cuts=[(20.0, 40.0)])
    after = [g for a, _, g in cut["bins"] if 20 <= a < 22]
    assert after and all(g == pytest.approx(3 * 0.25, abs=0.01) for g in after)
    assert [g for a, _, g in no_cut["bins"] if 20 <= a < 20.5] == [pytest.approx(1.5)]
    assert cut["ratio"] == pytest.approx((30 + 15) / 60, abs=0.02)
    assert no_cut["ratio"] == pytest.approx(cut["ratio"] + 3 * 1.0 * 0.5 / 60, abs=0.005)
    # acted on at 21 s: from then the window reaches back as before
    cuts = fault_cuts([{"replica_group": 1, "at": 20.0}], {1: [19.0, 20.5]}, 30.0)
    assert cuts == [(20.0, 20.5)]
    acted = goodput_from_commits(commits, 10, 30, B, 3, cuts=cuts)
    assert cut["ratio"] < acted["ratio"] <= no_cut["ratio"]


def test_ledger_badput_in_a_window_counts_only_the_window():
    ivs = [{"start": 0.0, "end": 10.0, "cause": "unattributed", "replica_seconds": 20.0},
           {"start": 12.0, "end": 14.0, "cause": "stall", "replica_seconds": 6.0},
           {"start": 30.0, "end": 31.0, "cause": "stall", "replica_seconds": 3.0}]
    assert badput_in_window(ivs, 5.0, 20.0) == {"stall": 6.0, "unattributed": 10.0}


def test_vs_fault_free_three_ways_and_the_faults_cost():
    def run(name, gt, rec, led, incs=()):
        return {"run": name, "goodput": {"ratio": gt},
                "reconciliation": [{"check": "goodput ratio over the ledger's window",
                                    "ground_truth": rec, "ledger": led, "ok": True}],
                "ledger_reconciled_window": {"ratio": led, "expected_s": 360.0},
                "ledger_incidents": [{"kind": k, "cost_replica_s": c} for k, c in incs]}
    text = vs_fault_free([run("fault_free", 0.8, 0.9, 0.92),
                          run("lightkeeper", 0.96, 0.81, 0.828,
                              [("hang", 6.0), ("straggler", 12.0)])])
    assert "lightkeeper: 1.200x | 0.900x | 0.900x; faults 18.0 = 0.050 (hang 6.0, " \
           "straggler 12.0)" in text


def test_slow_commits_are_credited_whole_across_bins_shorter_than_a_step():
    """b = 0.8 s, one commit a second (0.8x pace, slow): a commit holds 0.8 s of a 0.5 s bin;
    the rest carries to the next bin, so the group keeps 0.8 of its time (0.5 if capped)."""
    commits = {0: steady(0, 60, 1.0)}
    gp = goodput_from_commits(commits, 20, 60, 0.8, 1)
    assert gp["ratio"] == pytest.approx(0.8, abs=0.02)
