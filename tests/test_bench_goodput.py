"""benchmarks/bench_goodput.py's pure functions (benchmarks/goodput_truth.py): the ground truth it
reads from the ranks' logs, goodput and each fault's cost by the ledger's definitions on commit
times, and the reconciliation with the ledger.
Plain data, no processes (the benchmark itself is run by hand: docs/goodput.md, Benchmark)."""

from __future__ import annotations

import time

import pytest

from benchmarks.bench_goodput import vs_fault_free
from benchmarks.goodput_truth import (
    back_at_pace,
    badput_by_window,
    badput_in_window,
    fault_truth,
    goodput_from_commits,
    healthy_step_s,
    job_commit_times,
    ledger_window,
    lost_seconds,
    parse_commit_log,
    reconcile,
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
    assert healthy_step_s({0: [1.0, 2.0]}, 0, 5) is None  # too few steps for a mean


def test_healthy_step_is_the_mean_step_the_ledger_samples_not_the_median_gap():
    # uneven steps (one waits on a peer, the next two are short): 0.2, 0.2, 0.5 s repeating
    times = [0.0]
    for i in range(30):
        times.append(times[-1] + (0.5 if i % 3 == 2 else 0.2))
    commits = {g: [t + 0.01 * g for t in times] for g in range(3)}
    assert healthy_step_s(commits, 0, times[-1] + 1) == pytest.approx(0.3)
    # only the commits inside the span count: the first 3 steps (0.9 s)
    assert healthy_step_s({0: times}, 0, 0.95) is None
    assert healthy_step_s({0: times, 1: times}, 0, 0.95) == pytest.approx(0.3)


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


def test_back_at_pace_is_counted_from_the_onset_and_must_hold():
    """W = 5 s. A straggler from 10 s (quarter pace): the windows reaching back before it do
    not count. Back at full pace for one window (20-25 s), then stalled until 30 s: not back
    until the pace holds, from 30 s, if the next fault (the horizon) lets it be seen."""
    job = steady(0, 10) + [10 + t for t in steady(0, 10, 4 * B)] + [20 + t for t in
                                                                   steady(0, 5)]
    job += [30 + t for t in steady(0, 30)]
    assert back_at_pace(job, 10.0, 60.0, B) == pytest.approx(30 + B)
    assert back_at_pace(job, 10.0, 34.0, B) is None  # the next fault struck at 34 s
    # held for as long as the horizon allows: a window at pace just before it is enough
    assert back_at_pace(job, 10.0, 25.5, B) == pytest.approx(20.0)


def test_lost_seconds_is_expected_minus_actual_commits_in_seconds():
    assert lost_seconds(steady(0, 40), 10, 30, B) == pytest.approx(0.0)
    assert lost_seconds(steady(0, 40, 2 * B), 10, 30, B) == pytest.approx(10.0)
    assert lost_seconds(steady(0, 40, 0.5 * B), 10, 30, B) == 0.0  # faster: nothing, not < 0
    gap = steady(0, 15) + [20 + t for t in steady(0, 20)]  # nothing from 15 s to 20 s
    assert lost_seconds(gap, 10, 30, B) == pytest.approx(5.0)
    # a commit covers the step before it: split where the window falls, never lost to it
    assert lost_seconds(gap, 10, 17.6, B) + lost_seconds(gap, 17.6, 30, B) == \
        pytest.approx(5.0)
    assert lost_seconds([], 3, 7, B) == pytest.approx(4.0)


def test_job_commit_times_follow_the_newest_step_only():
    steps = {0: [(1.0, 1), (2.0, 2), (3.0, 3)], 1: [(1.1, 1), (2.5, 2), (9.0, 3)],
             2: [(8.0, 2)]}  # group 2 healed to step 2 late: not a job step
    assert job_commit_times(steps) == [2.0, 3.0]


def hang_job():
    """Group 2 hangs at 20 s (every group stalls), is evicted at 22 s and exits at 22.5 s;
    the survivors go on at full pace from 23 s, group 2 commits again from 26 s."""
    commits = {g: steady(0, 20) + [23 + t for t in steady(0, 37)] for g in (0, 1)}
    commits[2] = steady(0, 20) + [26 + t for t in steady(0, 34)]
    steps = {g: [(t, i + 1) for i, t in enumerate(times)] for g, times in commits.items()}
    strikes = [{"replica_group": 2, "kind": "hang", "at": 20.0}]
    return commits, job_commit_times(steps), strikes


def test_fault_truth_costs_a_hang_from_the_ranks_commits_by_cause():
    commits, jt, strikes = hang_job()
    [f] = fault_truth(strikes, commits, jt, B, 60.0, 3, {2: [22.0]}, {2: [22.5]})
    assert f["back"] == pytest.approx(23 + B) and f["recovery_s"] == pytest.approx(3.25)
    assert f["rejoined"] == pytest.approx(26 + B)
    # every group stalled 20-22 s; the survivors 22-23 s (their first commit covers 23-23.25);
    # group 2's slot from its eviction to its first commit again, less that commit's step
    assert f["by_cause"] == {"stall": pytest.approx(6.0), "recovery": pytest.approx(2.0),
                             "capacity_lost": pytest.approx(4.0)}
    assert f["cost_replica_s"] == pytest.approx(12.0)


def test_fault_truth_gives_a_later_fault_the_survivors_time_from_its_onset():
    """A straggler in group 1 from 10 s (the job at quarter pace), evicted at 14 s, out until
    it commits again at 30 s; group 2 hangs at 18 s, before the job is back at pace, evicted
    at 20 s: from 18 s the survivors' time is the hang's, group 1's slot stays the
    straggler's until it commits again."""
    slow = steady(0, 10) + [10 + t for t in steady(0, 4, 4 * B)]  # 11, 12, 13, 14
    commits = {0: slow + [15 + t for t in steady(0, 3)] + [21 + t for t in steady(0, 39)],
               1: slow + [30 + t for t in steady(0, 30)],
               2: slow + [15 + t for t in steady(0, 3)] + [25 + t for t in steady(0, 35)]}
    steps = {g: [(t, i + 1) for i, t in enumerate(times)] for g, times in commits.items()}
    strikes = [{"replica_group": 1, "kind": "slow_compute", "at": 10.0},
               {"replica_group": 2, "kind": "hang", "at": 18.0}]
    slow_f, hang_f = fault_truth(strikes, commits, job_commit_times(steps), B, 60.0, 3,
                                 {1: [14.0], 2: [20.0]}, {1: [14.5], 2: [20.5]})
    assert slow_f["back"] is None and slow_f["horizon"] == 18.0  # W = 5 s: no room before 18
    assert slow_f["rejoined"] == pytest.approx(30 + B)
    # 10-14 s: 3 groups x 4 s, 4 commits of 0.25 s each; 14-15 s: the survivors, then at
    # pace until the hang; group 1 out from 14 s until its commit at 30.25 s
    assert slow_f["by_cause"] == {"straggler_drag": pytest.approx(9.0),
                                  "recovery": pytest.approx(2.0),
                                  "capacity_lost": pytest.approx(16.0)}
    # the hang: groups 0 and 2 stalled 18-20 s; group 0 waits until 21 s, group 2 out until
    # it commits again at 25.25 s
    assert hang_f["by_cause"] == {"stall": pytest.approx(4.0), "recovery": pytest.approx(1.0),
                                  "capacity_lost": pytest.approx(5.0)}
    assert hang_f["back"] == pytest.approx(21 + B)


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


def hang_incident(**kw) -> dict:
    """The ledger's incident for :func:`hang_job`, as the ground truth has it."""
    inc = {"id": 1, "kind": "hang", "replica_group": 2, "onset_at": 20.0, "detected_at": 21.5,
           "evicted_at": 22.0, "back_to_pace_at": 23.25, "back_to_pace": "reached",
           "recovery_s": 3.25, "cost": {"replica_seconds": 12.0, "by_cause": {
               "stall": 6.0, "recovery": 2.5, "capacity_lost": 3.5}}}
    return {**inc, **kw}


def by_check(checks: list[dict]) -> dict[str, dict]:
    return {c["check"].split(": ", 1)[-1]: c for c in checks}


def test_reconcile_agrees_with_a_ledger_that_matches_the_ground_truth():
    commits, jt, strikes = hang_job()
    faults = fault_truth(strikes, commits, jt, B, 60.0, 3, {2: [22.0]}, {2: [22.5]})
    led = ledger_of(commits, 5, 60, B, 3)
    truth = goodput_from_commits(commits, 5, 60, B, 3, cuts=[(20.0, 23.25)])
    checks = reconcile(led, truth, faults, [hang_incident()])
    assert all(c["ok"] for c in checks), checks
    got = by_check(checks)
    # the split between the survivors' recovery and the evicted group's capacity is not
    # judged, their sum is
    assert got["cost after (recovery + capacity_lost) (replica-s)"]["diff"] == 0.0
    assert got["onset -> back at pace (s)"]["diff"] == 0.0
    assert got["incidents no fault explains"]["note"] == "none"


def test_reconcile_catches_a_ledger_off_by_what_one_fault_costs():
    """What the old reconciliation let pass (it judged the ground truth with the ledger's own
    baseline, cut each fault at the ledger's eviction, 5% of the window as its tolerance):
    4 replica-s more goodput (2.4% here), a hang's stall 2.5 replica-s short, back at pace
    1.75 s late."""
    commits, jt, strikes = hang_job()
    faults = fault_truth(strikes, commits, jt, B, 60.0, 3, {2: [22.0]}, {2: [22.5]})
    truth = goodput_from_commits(commits, 5, 60, B, 3, cuts=[(20.0, 23.25)])
    led = ledger_of(commits, 5, 60, B, 3, extra_good=4.0)  # 2.4% of the window
    short = hang_incident(cost={"replica_seconds": 9.5, "by_cause": {
        "stall": 3.5, "recovery": 2.5, "capacity_lost": 3.5}})
    got = by_check(reconcile(led, truth, faults, [short]))
    assert not got["goodput over the ledger's window (replica-s)"]["ok"]
    assert not got["cost (replica-s)"]["ok"]
    assert not got["cost before it was acted on (replica-s)"]["ok"]
    assert got["cost after (recovery + capacity_lost) (replica-s)"]["ok"]
    late = hang_incident(back_to_pace_at=25.0, recovery_s=5.0)
    assert not by_check(reconcile(led, truth, faults, [late]))[
        "onset -> back at pace (s)"]["ok"]


def test_reconcile_matches_an_incident_by_group_and_kind_and_says_what_it_found():
    commits, jt, strikes = hang_job()
    faults = fault_truth(strikes, commits, jt, B, 60.0, 3, {2: [22.0]}, {2: [22.5]})
    led = ledger_of(commits, 5, 60, B, 3)
    for wrong in (hang_incident(kind="straggler"), hang_incident(replica_group=1)):
        checks = reconcile(led, None, faults, [wrong])
        mine = [c for c in checks if c["check"].startswith("hang in group 2")]
        assert [c["check"] for c in mine] == ["hang in group 2: its incident"], checks
        assert not mine[0]["ok"] and "the ledger has: " in mine[0]["note"]
        assert f"{wrong['kind']} in group {wrong['replica_group']} at +0.0 s" in mine[0]["note"]
    assert reconcile(led, None, faults, [])[1] == {
        "check": "hang in group 2: its incident", "ok": False,
        "note": "no hang incident of group 2; the ledger has: none"}
    # no truth for the goodput: a failed check, never a silent one
    assert reconcile(led, None, faults, [hang_incident()])[0]["ok"] is False


def test_reconcile_back_at_pace_needs_both_or_neither():
    """A recovery another fault's confirmation ended (``superseded``) is no failure where the
    ranks were not back at pace before the next fault struck either; where they were, it
    is, as is a ledger back at pace the ranks never were."""
    commits, jt, strikes = hang_job()
    led = ledger_of(commits, 5, 60, B, 3)
    faults = fault_truth(strikes, commits, jt, B, 60.0, 3, {2: [22.0]}, {2: [22.5]})
    superseded = hang_incident(back_to_pace="superseded", back_to_pace_at=22.8,
                               superseded_by=2)
    got = by_check(reconcile(led, None, faults, [superseded]))["onset -> back at pace (s)"]
    assert not got["ok"] and got["ground_truth"] == 3.25, got
    # a second fault at 24 s: the ranks never had a whole window at pace before it
    second = strikes + [{"replica_group": 0, "kind": "hang", "at": 24.0}]
    faults = fault_truth(second, commits, jt, B, 60.0, 3, {2: [22.0]}, {2: [22.5]})
    assert faults[0]["back"] is None
    got = by_check(reconcile(led, None, faults, [superseded]))
    assert got["onset -> back at pace (s)"] == {
        "check": "hang in group 2: onset -> back at pace (s)", "ok": True,
        "note": "neither: the ranks not back at pace before the next fault's onset; the "
                "ledger superseded by incident 2"}
    got = by_check(reconcile(led, None, faults, [hang_incident()]))
    assert not got["onset -> back at pace (s)"]["ok"]
    assert "the ranks were not back" in got["onset -> back at pace (s)"]["note"]


def test_an_incident_in_a_healthy_stretch_fails_one_in_a_fault_s_window_does_not():
    commits, jt, strikes = hang_job()
    faults = fault_truth(strikes, commits, jt, B, 60.0, 3, {2: [22.0]}, {2: [22.5]})
    led = ledger_of(commits, 5, 60, B, 3)
    dead = {"id": 2, "kind": "dead", "replica_group": 2, "onset_at": 22.4}
    slow = {"id": 3, "kind": "job_slow", "replica_group": None, "onset_at": 40.0,
            "cost": {"replica_seconds": 3.1}}
    got = by_check(reconcile(led, None, faults, [hang_incident(), dead, slow]))
    assert got["incidents no fault explains"] == {
        "check": "incidents no fault explains", "ok": False,
        "note": "job_slow in group None, 3.1 replica-s"}


def test_a_fault_cuts_the_pace_window_at_its_onset():
    """Group pace halves at 20 s: the window W (20 x 0.25 = 5 s) still holds the commits
    before it, so without the cut the first bins after the strike count whole; cut at the
    onset, each counts its own commits x b from the strike on (until the job is back)."""
    slow = steady(0, 20) + [20 + t for t in steady(0, 20, 2 * B)]
    commits = {0: slow, 1: slow, 2: slow}
    no_cut = goodput_from_commits(commits, 10, 30, B, 3)
    cut = goodput_from_commits(commits, 10, 30, B, 3, cuts=[(20.0, 40.0)])
    after = [g for a, _, g in cut["bins"] if 20 <= a < 22]
    assert after and all(g == pytest.approx(3 * 0.25, abs=0.01) for g in after)
    assert [g for a, _, g in no_cut["bins"] if 20 <= a < 20.5] == [pytest.approx(1.5)]
    assert cut["ratio"] == pytest.approx((30 + 15) / 60, abs=0.02)
    assert no_cut["ratio"] == pytest.approx(cut["ratio"] + 3 * 1.0 * 0.5 / 60, abs=0.005)


def test_ledger_badput_in_a_window_counts_only_the_window():
    ivs = [{"start": 0.0, "end": 10.0, "cause": "unattributed", "replica_seconds": 20.0},
           {"start": 12.0, "end": 14.0, "cause": "stall", "replica_seconds": 6.0},
           {"start": 30.0, "end": 31.0, "cause": "stall", "replica_seconds": 3.0}]
    assert badput_in_window(ivs, 5.0, 20.0) == {"stall": 6.0, "unattributed": 10.0}


def test_vs_fault_free_three_ways_and_the_faults_cost():
    def run(name, gt, rec, led, incs=(), truth=()):
        return {"run": name, "goodput": {"ratio": gt}, "goodput_ledger_window": {"ratio": rec},
                "ledger_reconciled_window": {"ratio": led, "expected_s": 360.0},
                "ledger_incidents": [{"kind": k, "cost_replica_s": c} for k, c in incs],
                "recovery": [{"fault": k, "cost_replica_s": c} for k, c in truth]}
    text = vs_fault_free([run("fault_free", 0.8, 0.9, 0.92),
                          run("lightkeeper", 0.96, 0.81, 0.828,
                              [("hang", 6.0), ("straggler", 12.0)],
                              [("slow_compute (group 1)", 12.5), ("hang (group 2)", 6.2)])])
    assert "lightkeeper: 1.200x | 0.900x | 0.900x; faults 18.0 = 0.050 (hang 6.0, " \
           "straggler 12.0); ground truth: slow_compute (group 1) 12.5, hang (group 2) 6.2" \
           in text


def test_slow_commits_are_credited_whole_across_bins_shorter_than_a_step():
    """b = 0.8 s, one commit a second (0.8x pace, slow): a commit holds 0.8 s of a 0.5 s bin;
    the rest carries to the next bin, so the group keeps 0.8 of its time (0.5 if capped)."""
    commits = {0: steady(0, 60, 1.0)}
    gp = goodput_from_commits(commits, 20, 60, 0.8, 1)
    assert gp["ratio"] == pytest.approx(0.8, abs=0.02)
