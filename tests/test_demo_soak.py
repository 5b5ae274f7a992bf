"""The soak's schedule and its summary (``lightkeeper demo --soak``; lightkeeper/soak.py).

The soak itself runs for 20 minutes on namespaced hosts: a benchmark, not a test
(benchmarks/results/README.md). Here: the seeded schedule covers every kind of the grammar and
repeats with its seed, and the summary's arithmetic on a report whose figures are known.
"""

from __future__ import annotations

from lightkeeper.scenario import parse_inject, soak_faults
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
    hang = _fault("hang", 1, 30.0, 40.0, {"recovery_s": 25.0, "stall_s": 25.0, "job_steps": 50},
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
