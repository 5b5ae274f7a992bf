"""A fault's recovery stage by stage, its measured cost and torchft alone's computed cost
(:mod:`lightkeeper.recovery`), from plain data in the shapes the demo records (rank samples,
the Lighthouse's ``/status`` as it changed, the monitor's ``/v1/goodput``). The real processes
run in ``tests/test_demo_e2e.py``."""

from __future__ import annotations

import pytest

from lightkeeper import recovery

T0 = 1_800_000_000.0
RID = "replica_group_2:dead"
NEW = "replica_group_2:beef"


def sample(t, g, step, last, rid=None, q=3, participating=True):
    return {"t": t, "replica_group": g, "rank": g, "step": step, "last_step_at_s": last,
            "replica_id": rid or f"replica_group_{g}:x", "quorum_id": q,
            "participating": participating}


def hang_run():
    """3 groups at 5 steps/s until a hang at 10.0 s (group 2); evicted at 11.5 s; the others
    commit again at 12.6 s at full pace; group 2 back (new incarnation) at 16.0 s, the job
    stalls 1.2 s while it joins, then all three go on."""
    out = []
    step = 0
    t = 0.0
    while t < 10.0:
        step += 1
        t = round(step * 0.2, 2)
        for g in range(3):
            out.append(sample(t, g, step, t, RID if g == 2 else None))
    t = 12.6
    while t < 16.0:
        step += 1
        for g in (0, 1):
            out.append(sample(round(t, 2), g, step, round(t, 2), q=4))
        t += 0.2
    t = 17.2  # the join stalled the job 16.0 -> 17.2
    out.append(sample(16.0, 2, 0, None, NEW, q=5))
    while t < 24.0:
        step += 1
        for g in range(3):
            out.append(sample(round(t, 2), g, step, round(t, 2), NEW if g == 2 else None, q=5))
        t += 0.2
    return out


HANG = {"replica_group": 2, "spec": "hang:at_step=50", "struck_at_s": 10.0,
        "detected_at_s": 11.4, "evicted_at_s": 11.5, "survivors_committing_at_s": 12.6,
        "restarted_at_s": 12.0, "rejoined_at_s": 16.5}
EVICTIONS = [{"replica_group": 2, "decision": "evict", "replica_id": RID, "at_s": 11.5}]
LIGHTHOUSE = [
    {"t": 5.0, "quorum_id": 3, "members": ["g0", "g1", RID], "heartbeating": ["g0", "g1", RID],
     "stale": []},
    {"t": 12.5, "quorum_id": 4, "members": ["g0", "g1"], "heartbeating": ["g0", "g1"],
     "stale": [RID]},
    {"t": 16.0, "quorum_id": 5, "members": ["g0", "g1", NEW],
     "heartbeating": ["g0", "g1", NEW], "stale": [RID]}]


def test_commit_series_and_back_at_pace():
    series = recovery.commit_series(hang_run())
    assert series[0] == (0.2, 1) and recovery.step_at(series, 10.1) == 50
    assert recovery.step_at(series, 0.1) is None
    # the job is back at >= 90% of 5 steps/s from its first commit after the hang; not before
    assert recovery.back_at_pace(series, 11.5, 5.0, last_t=24.0) == 12.6
    # the window must fit in what was observed
    assert recovery.back_at_pace(series, 22.0, 5.0, last_t=24.0) is None
    assert recovery.back_at_pace(series, 11.5, None, last_t=24.0) is None
    assert recovery.job_stall(series, 15.0, 21.0) == pytest.approx(1.2, abs=0.21)


def test_back_at_pace_does_not_follow_where_the_looks_fall():
    """Commits seen every 0.52 s, two steps each (3.85 steps/s, the healthy rate): a 3 s
    window holds 5 looks (10 steps, under 90% of 11.5), yet the job never left its pace."""
    series = [(10.0 + 0.52 * k, 40 + 2 * k) for k in range(40)]
    assert recovery.back_at_pace(series, 10.0, 3.85, last_t=40.0) == 10.0
    # a job at 80% of that pace is not back
    slow = [(10.0 + 0.65 * k, 40 + 2 * k) for k in range(40)]
    assert recovery.back_at_pace(slow, 10.0, 3.85, last_t=40.0) is None


def test_stages_of_a_hang():
    st = recovery.stages(HANG, hang_run(), LIGHTHOUSE, EVICTIONS, 5.0, end=24.0)
    assert st["evicted_replica_id"] == RID
    assert (st["onset"], st["detected"], st["kill_sent"]) == (10.0, 11.4, 11.5)
    assert st["lighthouse_dropped"] == 12.5 and st["survivors_quorum"] == 12.5
    assert st["back_at_pace"] == 12.6
    assert st["joined"] == 16.0 and st["healed"] == 16.5
    dip = st["join_dip"]
    assert dip["stalled"] and dip["stall_s"] >= 1.0 and dip["min_vs_healthy"] < 0.9
    assert st["steps_to_detect"] == 0  # a hung group commits nothing


def test_stages_without_an_eviction_stop_at_the_detection():
    f = dict(HANG, evicted_at_s=None, survivors_committing_at_s=None, rejoined_at_s=None)
    st = recovery.stages(f, hang_run(), LIGHTHOUSE, [], 5.0, end=24.0)
    assert st["kill_sent"] is None and st["back_at_pace"] is None and st["joined"] is None


def test_ledger_incident_is_matched_by_group_and_detection():
    goodput = {"incidents": [
        {"id": 1, "kind": "straggler", "replica_group": 1, "detected_at": T0 + 11.4},
        {"id": 2, "kind": "hang", "replica_group": 2, "detected_at": T0 + 11.3,
         "onset_at": T0 + 10.0, "evicted_at": T0 + 11.5, "back_to_pace_at": T0 + 12.7,
         "recovery_s": 2.7, "detect_s": 1.3, "open": False,
         "cost": {"replica_seconds": 9.0, "group_steps": 45.0,
                  "by_cause": {"stall": 4.0, "recovery": 2.0, "capacity_lost": 3.0}}}]}
    inc = recovery.ledger_incident(HANG, goodput, T0)
    assert inc["id"] == 2
    cost = recovery.measured_cost(inc, T0, groups=3)
    assert cost["source"].startswith("measured")
    assert cost["job_steps"] == 15.0 and cost["back_to_pace_s"] == 12.7
    assert recovery.ledger_incident(HANG, {"incidents": []}, T0) is None
    assert recovery.ledger_incident(HANG, None, T0) is None
    # a crash the story saw no detection of: its dead incident is found by its onset
    crash = dict(HANG, spec="crash:at_step=50", detected_at_s=None)
    dead = {"id": 3, "kind": "dead", "replica_group": 2, "detected_at": T0 + 14.0,
            "onset_at": T0 + 10.2}
    assert recovery.ledger_incident(crash, {"incidents": [dead]}, T0)["id"] == 3


DEMO = {"pg_timeout_s": 20.0, "quorum_timeout_s": 60.0, "join_timeout_ms": 1000}


def test_torchft_alone_hang_at_the_demo_settings_and_at_defaults():
    a = recovery.torchft_alone(HANG, groups=3, horizon_s=100.0, healthy_rate=5.0,
                               slow_rate=None, settings=DEMO)
    assert a["source"].startswith("computed")
    # 20 s process-group timeout + 1 s join timeout, all 3 groups idle; then 1 group lost
    assert a["stall_s"] == 21.0 and a["recovery_s"] == 21.0
    assert a["replica_seconds"] == pytest.approx(3 * 21 + 79)
    assert a["job_steps"] == round(142 / 3 * 5)  # the lost group's 79 s count, not the stall's
    d = recovery.torchft_alone(HANG, groups=3, horizon_s=100.0, healthy_rate=5.0,
                               slow_rate=None, settings=recovery.TORCHFT_DEFAULTS)
    assert "dies at +120 s" in d["outcome"] and d["recovery_s"] is None
    assert d["replica_seconds"] == 300.0


def test_torchft_alone_straggler_drags_to_the_end():
    f = {"replica_group": 1, "spec": "slow_compute:delay=0.6,from_step=30"}
    a = recovery.torchft_alone(f, groups=3, horizon_s=60.0, healthy_rate=5.0, slow_rate=1.25,
                               settings=DEMO)
    assert a["recovery_s"] is None and a["replica_seconds"] == pytest.approx(3 * 60 * 0.75)
    assert a["job_steps"] == 225 and a["per_hour_after_replica_s"] == pytest.approx(8100.0)
    # a slow link drags the job alike (its torchft-alone cell was empty, so a soak counted it
    # as costing torchft nothing)
    link = recovery.torchft_alone({"replica_group": 1, "spec": "slow_link:mbit=20"}, groups=3,
                                  horizon_s=60.0, healthy_rate=5.0, slow_rate=1.25,
                                  settings=DEMO)
    assert link["replica_seconds"] == a["replica_seconds"] and "slow link" in link["basis"]
    # nothing to compute from: no horizon, no measured slow pace, a kind torchft handles itself
    assert recovery.torchft_alone(f, groups=3, horizon_s=None, healthy_rate=5.0,
                                  slow_rate=1.25, settings=DEMO) is None
    assert recovery.torchft_alone(f, groups=3, horizon_s=60.0, healthy_rate=5.0,
                                  slow_rate=None, settings=DEMO) is None
    # its phase no slower than the healthy one (the box sped up or slowed down): no figure
    assert recovery.torchft_alone(f, groups=3, horizon_s=60.0, healthy_rate=5.0,
                                  slow_rate=4.9, settings=DEMO) is None
    assert recovery.torchft_alone({"spec": "crash:at_step=3"}, groups=3, horizon_s=60.0,
                                  healthy_rate=5.0, slow_rate=None, settings=DEMO) is None


def test_torchft_alone_partition_never_recovers_and_a_host_offline_waits_the_timeout():
    part = recovery.torchft_alone({"replica_group": 0, "spec": "partition:at_step=40"},
                                  groups=3, horizon_s=50.0, healthy_rate=4.0, slow_rate=None,
                                  settings=DEMO)
    assert part["recovery_s"] is None and part["stall_s"] == 50.0
    assert part["replica_seconds"] == 150.0 and part["job_steps"] == 200
    assert "stops for good" in part["outcome"]
    off = recovery.torchft_alone({"replica_group": 0, "spec": "host_offline:at_step=40"},
                                 groups=3, horizon_s=50.0, healthy_rate=4.0, slow_rate=None,
                                 settings=DEMO)
    # the survivors wait the 20 s process-group timeout, then one group's capacity is lost
    assert off["stall_s"] == off["recovery_s"] == 20.0
    assert off["replica_seconds"] == pytest.approx(3 * 20 + 30) and off["job_steps"] == 120
    # gone between two collectives (no survivor held, none told to abort): torchft's own
    # quorum goes on once the Lighthouse stops hearing it, not after the 20 s timeout
    between = recovery.torchft_alone({"replica_group": 0, "spec": "host_offline:at_step=40"},
                                     groups=3, horizon_s=50.0, healthy_rate=4.0,
                                     slow_rate=None, settings={**DEMO,
                                                               "heartbeat_timeout_ms": 1000},
                                     blocked=False)
    assert between["stall_s"] == 1.0 and "heartbeat timeout" in between["outcome"]
    assert between["replica_seconds"] == pytest.approx(3 * 1 + 49)


def test_torchft_alone_job_steps_are_the_measured_costs_job_steps():
    """Every kind's job steps are its replica-seconds turned into job steps as the measured
    cost's are (/ healthy step time / groups): after a hang's or a gone host's stall the lost
    group's capacity counts (the ledger's capacity_lost), not the stall alone."""
    rate = 4.0
    for spec, slow, settings in (("hang:at_step=40", None, DEMO),
                                 ("hang:at_step=40", None, recovery.TORCHFT_DEFAULTS),
                                 ("host_offline:at_step=40", None, DEMO),
                                 ("partition:at_step=40", None, DEMO),
                                 ("slow_compute:delay=0.6", 1.0, DEMO)):
        alone = recovery.torchft_alone({"replica_group": 0, "spec": spec}, groups=3,
                                       horizon_s=50.0, healthy_rate=rate, slow_rate=slow,
                                       settings=settings)
        inc = {"id": 1, "cost": {"replica_seconds": alone["replica_seconds"],
                                 "group_steps": alone["replica_seconds"] * rate}}
        measured = recovery.measured_cost(inc, T0, groups=3)
        assert alone["job_steps"] == round(measured["job_steps"]), (spec, settings)


def test_a_job_wide_stall_a_fault_caused_is_its_cost_and_its_detection():
    """After a partition's group is evicted the survivors wait in their collective: the ledger
    opens a job-wide incident (no replica group) and the monitor a job_stall. Both were "no
    fault" in the report, and that stall was left out of the partition's cost."""
    from lightkeeper.report import attributed_fault

    part = {"replica_group": 0, "spec": "partition:at_step=40", "struck_at_s": 10.0,
            "injected_at_s": 9.0, "detected_at_s": 13.0, "rejoined_at_s": 20.0}
    later = {"replica_group": 2, "spec": "hang:at_step=90", "struck_at_s": 30.0,
             "injected_at_s": 29.0, "detected_at_s": 31.0, "rejoined_at_s": 36.0}
    stall = {"id": 7, "kind": "job_stall", "replica_group": None, "onset_at": T0 + 14.0,
             "cost": {"replica_seconds": 1.5, "group_steps": 6.0, "by_cause": {"stall": 1.5}}}
    elsewhere = {"id": 8, "kind": "job_stall", "replica_group": None, "onset_at": T0 + 25.0,
                 "cost": {"replica_seconds": 2.0}}
    owners = recovery.job_wide_owners([part, later], {"incidents": [stall, elsewhere]}, T0,
                                      end=50.0)
    assert owners == {0: [stall]}  # 25 s lies in no fault's strike-to-rejoin window
    own = {"id": 3, "kind": "network", "replica_group": 0, "detected_at": T0 + 13.0,
           "cost": {"replica_seconds": 10.0, "group_steps": 40.0,
                    "by_cause": {"stall": 6.0, "capacity_lost": 4.0}}}
    cost = recovery.measured_cost(own, T0, groups=3, job_wide=owners[0])
    assert cost["replica_seconds"] == 11.5 and cost["job_steps"] == round(46.0 / 3, 1)
    assert cost["by_cause"] == {"stall": 7.5, "capacity_lost": 4.0}
    assert cost["job_wide_incidents"] == [7]
    detection = {"replica_group": None, "at_s": 14.5}
    assert attributed_fault(detection, [part, later], end=50.0) == 1
    assert attributed_fault({"replica_group": None, "at_s": 25.0}, [part, later], 50.0) is None
