"""Which fault a finding, a ledger incident and lost steps belong to in the demo's report
(:func:`lightkeeper.recovery.fault_windows`): a fault whose group never rejoins holds them until
the next fault of its group (a restart that never trained is still the fault's); a job-wide
finding is the open fault's that acted last, as its cost is. In-process, from plain data
in the shapes the demo records (``tests/test_demo_baseline.py``)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace as NS

from lightkeeper import demo as demo_cli
from lightkeeper import recovery, report
from lightkeeper.scenario import Scenario

T0 = 1_800_000_000.0


def fault(g: int, struck: float, detected: float | None, rejoined: float | None) -> dict:
    return {"replica_group": g, "group_rank": 0, "rank": g, "host": f"node-{g}",
            "spec": "slow_compute:delay=0.6,from_step=15,rank=0", "given": "live",
            "injected_at_s": struck - 1.0, "struck_at_s": struck, "detected_at_s": detected,
            "detected_kind": None if detected is None else "straggler", "finding_ranks": None,
            "culprit_ranks": None, "culprit_hosts": None, "evicted_at_s": None,
            "restarted_at_s": None, "survivors_committing_at_s": None,
            "rejoined_at_s": rejoined, "steps_lost": None,
            "outcome": "recovered" if rejoined else "not detected", "note": None,
            "host_quarantined_at_s": None, "restarted_on": None, "restarted_addr": None}


def ticks() -> list[tuple[float, int]]:
    """2 steps/s from 10 s, 1 step/s while a straggler is in (20-30 s, 40-50 s), to 60 s."""
    out, step, t = [], 0.0, 10.0
    while t <= 60.0 + 1e-9:
        out.append((round(t, 2), int(step)))
        step += 0.5 * (1.0 if 20.0 <= t < 30.0 or 40.0 <= t < 50.0 else 2.0)
        t += 0.5
    return out


def finding(g: int | None, at: float) -> dict:
    return {"kind": "straggler" if g is not None else "job_stall", "replica_group": g,
            "replica_id": None, "ranks": [], "confirmed_at": T0 + at}


def demo(faults, findings, goodput, events) -> NS:
    p = argparse.ArgumentParser()
    demo_cli.add_arguments(p)
    tk = ticks()
    return NS(args=p.parse_args(["--groups", "2", "--ranks-per-group", "1"]), sc=Scenario(),
              dir="/nonexistent", evictions=[], faults=faults, goodput=goodput,
              lighthouse_log=[], now=lambda: tk[-1][0] + 2, samples=[], ticks=tk,
              train_start_s=10.0, t0_unix=T0, interrupted=False, error=None,
              monitor_url=None, pids=list, prom_note=None, prom=None, events=events,
              findings=findings, user_url=lambda u: u, cluster=NS(lighthouse_url="http://lh"))


def test_a_fault_never_seen_to_rejoin_does_not_claim_the_next_faults_findings_steps_or_cost():
    # fault 1: a straggler in group 1 at 20 s the monitor missed, never rejoined (it passed at
    # 30 s); fault 2: another in group 1 at 40 s, caught at 41 s, group 1 back at 50 s
    faults = [fault(1, 20.0, None, None), fault(1, 40.0, 41.0, 50.0)]
    goodput = {"incidents": [  # fault 2's, its onset dated a little early; a later one
        {"id": 7, "kind": "straggler", "replica_group": 1, "onset_at": T0 + 39.5,
         "detected_at": T0 + 41.0, "open": False, "cost": {"replica_seconds": 5.0}},
        {"id": 8, "kind": "dead", "replica_group": 1, "onset_at": T0 + 55.0,
         "detected_at": None, "open": False, "cost": {"replica_seconds": 1.0}}]}
    events = [{"t": 48.0, "kind": "restarted", "replica_group": 1, "detail": "warm spare"}]
    at = {35.0: 1, 41.0: 2, 55.0: None}  # 55 s: after fault 2's rejoin, a false alarm
    rep = report.build_report(demo(faults, [finding(1, t) for t in at], goodput, events))
    assert {d["at_s"]: d["fault"] for d in rep["detections"]} == at
    one, two = rep["faults"]
    assert one["cost"] is None and two["cost"]["incident"] == 7  # neither 7 twice nor 8
    # each its own 10 s at half pace: fault 1's is not counted to the end of the run
    assert (one["steps_lost"], two["steps_lost"]) == (10, 10)


def test_a_crash_restarted_at_once_that_never_rejoins_keeps_its_dead_finding():
    """The supervisor restarts a crashed group at once; the monitor confirms the old
    incarnation's dead finding seconds later, and the group never trains again: the finding is
    the crash's, not a false alarm."""
    crash = fault(1, 20.0, None, None)
    demo_run = demo([crash], [finding(1, 23.0)], None,
                    [{"t": 20.5, "kind": "restarted", "replica_group": 1, "detail": "at once"}])
    assert [d["fault"] for d in report.build_report(demo_run)["detections"]] == [1]


def test_a_job_wide_finding_is_the_fault_its_cost_goes_to():
    # group 1's fault never rejoined; group 0's struck later and is still open at 27 s
    faults = [fault(1, 20.0, None, None), fault(0, 25.0, 26.0, 35.0)]
    stall = {"id": 9, "kind": "job_stall", "replica_group": None, "onset_at": T0 + 26.5}
    owners = recovery.job_wide_owners(faults, {"incidents": [stall]}, T0, 60.0)
    assert owners == {1: [stall]}
    assert report.attributed_fault({"replica_group": None, "at_s": 27.0}, faults, 60.0) == 2


def test_a_job_wide_stall_is_the_fault_that_acted_last_not_the_last_armed():
    """A crash given at start (armed at its group's launch, 2 s; its rank never reported the
    strike) caught at 40 s, after a straggler struck at 10 s whose group never rejoined: the
    survivors' stall after the crash's kill and its job_stall finding are the crash's, though
    the straggler's window started later than the crash's (its arming)."""
    crash = {**fault(2, 0.0, 40.0, 43.0), "given": "start", "spec": "crash:at_step=190",
             "injected_at_s": 2.0, "struck_at_s": None, "detected_kind": "dead"}
    faults = [crash, fault(1, 10.0, 11.4, None)]
    stall = {"id": 9, "kind": "job_stall", "replica_group": None, "onset_at": T0 + 40.2}
    assert recovery.job_wide_owners(faults, {"incidents": [stall]}, T0, 60.0) == {0: [stall]}
    assert report.attributed_fault({"replica_group": None, "at_s": 41.0}, faults, 60.0) == 1
    # the crash's window still starts at its arming (it may have struck any time after)
    assert recovery.fault_windows(faults, 60.0)[0] == (2.0, 43.0)
