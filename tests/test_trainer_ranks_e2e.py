"""Rank-level faults in real multi-rank replica groups, and the clock-free evidence each rank
serves: 3 replica groups x 2 ranks (FSDP2 inside a group over gloo, torchft across), every rank
its own process launched bare (RANK/WORLD_SIZE/MASTER_* set, group rank 0 hosts the store), a
real Lighthouse. Small model, short timeouts; every wait polls /v1/state with a deadline.

One job serves the module, in file order: the slow rank's evidence, a live in-group hang of
group 2 (its stacks, its live dumps analysed, the survivors' new quorum), then (group 2 killed) a
crash of group 0's rank 1."""

from __future__ import annotations

import time

import pytest
import requests

from lightkeeper.cluster import LocalCluster
from lightkeeper.processes import wait_until
from tests.support.workers import analyze_cli, save_dumps, struck_state, try_state

pytestmark = pytest.mark.e2e

TOKEN = "ranks-e2e-token"
DELAY = 0.3  # slow_compute's extra seconds per step on the slow rank


def group_states(c: LocalCluster) -> dict[tuple[int, int], dict] | None:
    """{(replica_group, group_rank): /v1/state} for every rank, or None while one is missing."""
    out = {}
    for g, grp in c.groups.items():
        for r, url in grp.worker_urls.items():
            s = try_state(url)
            if s is None:
                return None
            out[(g, r)] = s
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    # heartbeat 1000 ms (docs/lighthouse.md): a group gone (the crash below) stalls the last
    # one's quorum until its heartbeat expires; the default 5 s is only waited out
    c = LocalCluster(tmp_path_factory.mktemp("ranks3x2"), num_groups=3, ranks_per_group=2,
                     steps=100_000, pg_timeout_s=8, join_timeout_ms=3000, launcher="bare",
                     heartbeat_timeout_ms=1000,
                     extra_env={"NODE_NAME": "node-under-test", "LIGHTKEEPER_FAULT_TOKEN": TOKEN})
    try:
        c.start(faults={1: [f"slow_compute:delay={DELAY},rank=1"]}, timeout=180)
        yield c
    finally:
        c.stop()


def test_slow_rank_waits_least_in_group_and_its_group_least_across(job):
    def settled():
        s = group_states(job)
        # 16 steps of a 3-group quorum in every window: startup and heals have left it.
        return s if s and all(x["step"] >= 24 and x["num_participants"] == 3
                              and (x["timing"]["window"] or {}).get("steps", 0) >= 16
                              for x in s.values()) else None

    states = wait_until(settled, 240, interval=0.5, what="every rank 24 steps into a 3-group job")
    for (g, r), s in states.items():
        assert s["host"] == "node-under-test" and s["local_rank"] == r  # NODE_NAME, LOCAL_RANK
        assert (s["replica_group"], s["group_rank"], s["rank"]) == (g, r, 2 * g + r)
    w = {k: s["timing"]["window"] for k, s in states.items()}

    # Inside group 1 the slow rank is the one its peer waits for: it waits least in-group.
    assert w[(1, 1)]["wait_group_s"] < w[(1, 0)]["wait_group_s"], w
    assert w[(1, 0)]["wait_group_s"] >= DELAY / 2, w
    assert w[(1, 1)]["compute_s"] >= DELAY * 0.8, w
    # Across groups, group 1 arrives last at the all_reduce: its ranks wait least there.
    slow_group_cross = max(w[(1, r)]["wait_cross_s"] for r in (0, 1))
    others_cross = [w[(g, r)]["wait_cross_s"] for g in (0, 2) for r in (0, 1)]
    assert slow_group_cross < min(others_cross), w
    assert min(others_cross) >= DELAY / 2, w
    # The healthy groups do not wait for each other in-group the way the slow rank's peer
    # waits for it: at least DELAY / 2 less. Relative, not absolute: every rank waits in-group
    # a little each step (gloo's FSDP collectives and the commit vote), more on a busy machine.
    assert all(w[(g, r)]["wait_group_s"] <= w[(1, 0)]["wait_group_s"] - DELAY / 2
               for g in (0, 2) for r in (0, 1)), w

    # The groups that joined late healed (a sync quorum in multi-rank groups): the Manager's
    # bookkeeping read them without an error (torchft asserts an async quorum when asked
    # is_participating() while healing).
    assert all("bookkeeping failed" not in grp.log() for grp in job.groups.values())

    # /metrics has the same evidence as histograms, per scope.
    text = requests.get(job.groups[1].worker_urls[0] + "/metrics", timeout=5).text
    assert 'lightkeeper_collective_wait_seconds_bucket{group_rank="0",job="lightkeeper",' \
           'le="0.1",rank="2",replica_group="1",scope="group"}' in text
    assert "lightkeeper_step_compute_seconds_count" in text


def test_hang_in_group_posted_live_blocks_peer_inside_its_collective(job, tmp_path):
    """POST /v1/faults takes the rank-level grammar: group 2's rank 1 hangs before its forward;
    its peer blocks inside FSDP's all-gather (served as a group wait in progress); the other
    groups wait in the cross-group all_reduce, time out of it and go on without group 2 in a new
    quorum. While it hangs, /v1/stacks answers at once on the hung rank and on a waiting one, and
    ``lightkeeper analyze`` on the live dumps names the hung rank."""
    urls = job.groups[2].worker_urls

    def post_hang() -> str:
        at = max(try_state(u)["step"] for u in urls.values()) + 4
        spec = f"hang:at_step={at},where=group,rank=1"
        for u in urls.values():  # as the demo does: to every rank of the group
            r = requests.post(u + "/v1/faults", json={"spec": spec}, timeout=5,
                              headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200, r.text
        return spec

    spec = post_hang()
    hung_url, peer_url = urls[1], urls[0]
    at = struck_state(hung_url, spec)["step"]

    def peer_blocked():
        peer, hung = try_state(peer_url), try_state(hung_url)
        if not (peer and hung):
            return None
        waiting = peer["timing"]["waiting"]
        return (peer, hung) if (hung["step"] == at and waiting and waiting["scope"] == "group"
                                and waiting["seconds"] > 2.0) else None

    peer, hung = wait_until(peer_blocked, 60, interval=0.2,
                            what="group 2's rank 0 to be blocked in an in-group collective")
    assert hung["faults"] == [spec] and peer["faults"] == []
    assert hung["timing"]["waiting"] is None  # the culprit waits for nobody
    assert hung["phase"] == "forward"
    # Group 0 waits for group 2 in the cross-group all_reduce (until the 8 s timeout).
    cross_url = job.groups[0].worker_urls[0]
    wait_until(lambda: (s := try_state(cross_url)) and s["phase"] == "allreduce"
               and time.time() - s["phase_since"] > 1.0, 30, interval=0.2,
               what="group 0 to wait in its cross-group all_reduce")
    t0 = time.monotonic()
    stacks = requests.get(hung_url + "/v1/stacks", timeout=1).text
    t1 = time.monotonic()
    cross_stacks = requests.get(cross_url + "/v1/stacks", timeout=1).text
    t2 = time.monotonic()
    assert t1 - t0 < 1.0 and t2 - t1 < 1.0
    assert "before_forward" in stacks and "faults.py" in stacks  # blocked by the injected hang
    assert "loop.py" in cross_stacks and ".wait()" in cross_stacks  # waiting on its collective
    quorum = try_state(cross_url)["quorum_id"]
    # The same live dumps, analysed as a user would: inside group 2, rank 5 never arrived and
    # rank 4 waits for it; across the groups, only group 2's ranks are missing.
    urls_all = [u for g in range(3) for u in job.groups[g].worker_urls.values()]
    status, report = analyze_cli(*save_dumps(urls_all, tmp_path))
    hangs = [f for f in report["findings"] if f["kind"] == "hang"]
    assert status == 1 and hangs, report
    assert [(f["culprit_ranks"], f["waiting_ranks"]) for f in hangs
            if f["replica_group"] == 2] == [([5], [4])], hangs
    assert all(set(f["culprit_ranks"]) <= {4, 5} for f in hangs), hangs

    # Survivors: a new quorum without group 2 commits again while group 2 stays blocked.
    survivors = [u for g in (0, 1) for u in job.groups[g].worker_urls.values()]
    before = {u: try_state(u)["commits"] for u in survivors}
    wait_until(lambda: all((s := try_state(u)) and s["num_participants"] == 2
                           and s["quorum_id"] > quorum
                           and s["commits"] >= before[u] + 3 for u in survivors),
               90, interval=0.2, what="groups 0 and 1 to commit without group 2")
    assert job.groups[0].alive() and job.groups[1].alive()
    assert try_state(peer_url)["timing"]["waiting"]["scope"] == "group"
    assert job.groups[2].alive_ranks() == [0, 1]


def test_crash_of_one_rank_leaves_its_group_rank0_stuck_until_the_timeout(job):
    """torchft 0.2.0's behaviour (docs/trainer.md): with bare processes one rank of a group
    exits before its cross-group all_reduce; rank 0 of that group lives on, blocked in
    should_commit's in-group vote (its ManagerServer still heartbeating), until torchft's
    timeout fails it and it exits; the other groups go on without the group.

    On the module's job, after the hang above: group 2 (hung, still heartbeating) is killed
    first, or the last healthy group could never form a quorum (the Lighthouse needs more than
    half of the heartbeating groups); then group 0's rank 1 crashes and group 1 goes on alone."""
    pg_timeout = 8.0  # the module job's
    job.kill_group(2)
    grp = job.groups[0]
    urls = grp.worker_urls
    at = max(try_state(u)["step"] for u in urls.values()) + 3
    for u in urls.values():  # as the demo does: to every rank of the group
        r = requests.post(u + "/v1/faults", json={"spec": f"crash:at_step={at},rank=1"},
                          timeout=5, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
    wait_until(lambda: grp.rank_procs[1].poll() is not None, 120,
               what="group 0's rank 1 to exit")
    crashed_at = time.monotonic()
    assert grp.rank_procs[1].returncode == 1

    def rank0_stuck():
        s = try_state(urls[0])
        w = s and s["timing"]["waiting"]
        return s if w and w["scope"] == "group" and w["seconds"] > 2.0 else None

    stuck = wait_until(rank0_stuck, pg_timeout, interval=0.2,
                       what="group 0's rank 0 to wait in its group's commit vote")
    assert stuck["phase"] == "commit" and grp.rank_procs[0].poll() is None
    wait_until(lambda: grp.rank_procs[0].poll() is not None, pg_timeout + 30,
               what="group 0's rank 0 to fail at torchft's timeout")
    stalled = time.monotonic() - crashed_at
    assert grp.rank_procs[0].returncode != 0
    assert stalled >= pg_timeout - 3.0, stalled  # it lived on until the timeout
    survivors = list(job.groups[1].worker_urls.values())
    before = {u: try_state(u)["commits"] for u in survivors}
    wait_until(lambda: all((s := try_state(u)) and s["num_participants"] == 1
                           and s["commits"] >= before[u] + 3 for u in survivors),
               60, interval=0.2, what="group 1 to commit without groups 0 and 2")
