"""A dead rank's WorkerServer port, bound again by another process (WorkerServers bind ephemeral
ports): the monitor used to take the newcomer's answers for the dead rank's, so the rank stayed
"reachable" (no ``dead_rank``) and the stranger's state stood in the dead rank's group.

In process, on the detectors' synthetic job (tests/test_monitor_detectors.py): the view and the
findings are what the monitor serves on /v1/cluster and /v1/findings.
"""

from __future__ import annotations

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from monitor.poll.discovery import Target
from tests.support.monitor_sim import rank_state
from tests.test_monitor_detectors import T0, Job, sweep


def _stranger(job: str, group: int, rank: int) -> dict:
    s = rank_state(rank, group, now=T0)
    s.update(job=job, group_rank=0, group_world_size=2, host="elsewhere",
             timing={"recent": [], "waiting": None, "last_step": None, "window": None})
    return s


def test_another_jobs_rank_on_a_dead_ranks_port_leaves_that_rank_dead():
    job = Job()
    for s in job.states:
        s["job"] = "alpha"
    det = Detectors(DetectorConfig(dead_sweeps=3))
    job.steps(5, now=T0)
    sweep(det, job, T0)
    url = job.targets[3].url  # group 1's rank 1 dies; a rank of job beta binds its port
    job.states[3] = _stranger("beta", 0, 0)
    found = [f for t in (1, 2, 3) for f in sweep(det, job, T0 + t)]
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("dead_rank", 1, [3])]
    view = job.view(T0 + 4)
    rv = view.ranks[url]
    assert not rv.reachable and (rv.replica_group, rv.rank) == (1, 3)
    assert rv.state["job"] == "alpha" and rv.state["host"] == "host-g1"
    assert "job 'beta'" in rv.error
    assert [r.rank for r in view.groups[0].ranks] == [0, 1]  # beta's rank 0 is in no group


def test_another_rank_of_the_job_on_the_port_is_the_old_rank_gone_until_it_registers():
    job = Job()
    job.targets = [Target(t.url, "registered", replica_group=r // 2, rank=r)
                   for r, t in enumerate(job.targets)]
    det = Detectors(DetectorConfig(dead_sweeps=2))
    job.steps(5, now=T0)
    sweep(det, job, T0)
    url = job.targets[3].url  # group 1's rank 1 dies; group 2's restarted rank 4 binds its port
    job.states[3] = _stranger("sim", 2, 4)
    found = [f for t in (1, 2) for f in sweep(det, job, T0 + t)]
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("dead_rank", 1, [3])]
    assert not job.view(T0 + 3).ranks[url].reachable
    # the newcomer registers the address as its own: from then on it is rank 4's
    job.targets[3] = Target(url, "registered", replica_group=2, rank=4)
    rv = job.view(T0 + 4).ranks[url]
    assert rv.reachable and (rv.replica_group, rv.rank) == (2, 4)


def test_a_restarted_rank_on_its_own_port_is_that_rank_again():
    job = Job()
    det = Detectors(DetectorConfig(dead_sweeps=2))
    job.steps(5, now=T0)
    sweep(det, job, T0)
    job.states[3]["replica_id"], job.states[3]["pid"] = "replica_group_1:new", 4242
    assert [f for t in (1, 2, 3) for f in sweep(det, job, T0 + t)
            if f.kind in ("dead", "dead_rank")] == []
    assert job.view(T0 + 4).ranks[job.targets[3].url].reachable


def test_a_dead_ranks_bundle_holds_nothing_of_the_process_on_its_port(tmp_path):
    """The incident bundle of the dead rank's finding used to fetch /v1/stacks and /v1/fr_trace
    from its address, so the other job's rank's stacks and dump were filed as the dead rank's."""
    import json
    import time

    from monitor.evidence.rank import RankView
    from tests.support.monitor_sim import SimRanks
    from tests.support.views import scratch_view
    from tests.test_bundles import bundles_for, finding, hang_dumps, members

    sim = SimRanks.start(2, groups=1)  # group 0: ranks 0 and 1
    bundles, store = bundles_for(tmp_path, timeout_s=2.0)
    try:
        dumps = hang_dumps(2, absent=1)
        for r in sim.ranks:
            r.fr = dumps[r.state["rank"]]
        dead = dict(sim.ranks[1].state)
        sim.ranks[1].state = _stranger("beta", 0, 0)  # another job's rank on rank 1's port
        view = scratch_view(time.time(), {
            sim.ranks[0].url: RankView(sim.ranks[0].url, True, dict(sim.ranks[0].state)),
            sim.ranks[1].url: RankView(sim.ranks[1].url, False, dead, reason="bad_response",
                                       error="bad /v1/state: a rank of job 'beta' answers")})
        got = bundles.capture("confirm", view, view, {**finding(0, [1]), "kind": "dead_rank"},
                              3, None, [])
        files = members(bundles.store.path(got["id"]))
        by_rank = {r["rank"]: r for r in json.loads(files["manifest.json"])["ranks"]}
        assert by_rank[1]["stacks"].startswith("not asked: bad_response")
        assert by_rank[1]["fr_trace"] == by_rank[1]["stacks"]
        assert "fr/rank1.json" not in files and "stacks/rank1.json" not in files
        assert "fr/rank0.json" in files and by_rank[0]["stacks"] == "ok"
    finally:
        bundles.close()
        store.close()
        sim.stop()


def test_a_bundle_says_a_torch_only_rank_out_of_reach_was_not_asked(tmp_path):
    """A torch-only rank the sweep could not reach was filed as having no dump_traceback
    handler, which sends its reader looking for a torch version problem."""
    import json
    import time

    from monitor.evidence.rank import RankView
    from tests.support.views import scratch_view
    from tests.test_bundles import bundles_for, finding, members

    bundles, store = bundles_for(tmp_path, timeout_s=2.0)
    try:
        url = "torch+http://127.0.0.1:9"
        state = {"torch_only": {"flight_recorder": "ok"}, "rank": 1, "replica_group": 0, "group_rank": 1,
                 "replica_id": "replica_group_0:sim"}
        view = scratch_view(time.time(), {url: RankView(
            url, False, state, reason="timeout", error="no answer within 0.80s")})
        got = bundles.capture("confirm", view, view, finding(0, [1]), 3, None, [])
        [row] = json.loads(members(bundles.store.path(got["id"]))["manifest.json"])["ranks"]
        assert row["stacks"] == "not asked: timeout: no answer within 0.80s", row
    finally:
        bundles.close()
        store.close()
