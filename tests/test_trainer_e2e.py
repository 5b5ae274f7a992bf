"""The trainer and its WorkerServers with real parts: torchft's Lighthouse, gloo process groups,
one process per replica group. Timeouts are short so failures show within seconds."""

from __future__ import annotations

import subprocess
import time

import pytest
import requests

from lightkeeper.cluster import LocalCluster, wait_until
from tests.conftest import require_binary
from tests.support.workers import get_json, torchft_entries, try_state

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("train2"), num_groups=2, steps=100_000,
                     pg_timeout_s=10, step_pause_s=0.02)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        assert all(g.proc.poll() is not None for g in c.groups.values())


def states(c: LocalCluster, groups) -> list[dict] | None:
    out = [try_state(c.groups[g].worker_urls[0]) for g in groups]
    return out if all(out) else None


def test_two_groups_train_in_one_quorum_with_matching_collectives(cluster):
    def trained():
        s = states(cluster, [0, 1])
        return s if s and all(x["step"] >= 20 and x["num_participants"] == 2 for x in s) else None

    s0, s1 = wait_until(trained, 120, what="both groups at step 20 with 2 participants")
    later = wait_until(lambda: (x := states(cluster, [0, 1])) and min(y["step"] for y in x) > max(
        s0["step"], s1["step"]) and x, 30, what="steps to keep advancing")
    assert all(x["commits"] >= 20 for x in later)
    assert later[0]["quorum_id"] == later[1]["quorum_id"]
    assert later[0]["replica_id"].startswith("replica_group_0:")
    assert later[1]["replica_id"].startswith("replica_group_1:")

    dumps = [get_json(cluster.groups[g].worker_urls[0] + "/v1/fr_trace", 5) for g in (0, 1)]
    quorum = later[0]["quorum_id"]
    incs = [next(i for i in d["incarnations"] if i["quorum_id"] == quorum) for d in dumps]
    assert sorted(i["replica_rank"] for i in incs) == [0, 1]
    assert all(i["global_ranks"] == [0, 1] for i in incs)
    seqs = []
    for d, inc in zip(dumps, incs, strict=True):
        entries = torchft_entries(d, inc)
        assert entries and all(e["profiling_name"] == "gloo:all_reduce" for e in entries)
        seqs.append({e["collective_seq_id"]: e["input_sizes"] for e in entries})
    common = set(seqs[0]) & set(seqs[1])
    assert len(common) >= 10, "the cross-group all_reduce must show up on both groups"
    assert all(seqs[0][k] == seqs[1][k] for k in common)


def test_metrics_pass_promtool(cluster):
    promtool = require_binary("promtool")
    text = requests.get(cluster.groups[0].worker_urls[0] + "/metrics", timeout=2).text
    assert 'lightkeeper_step{group_rank="0",job="lightkeeper",rank="0",replica_group="0"}' in text
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_killed_group_survivor_commits_and_restart_heals(cluster):
    wait_until(lambda: states(cluster, [0, 1]), 30, what="both groups up")
    cluster.kill_group(1)
    before = try_state(cluster.groups[0].worker_urls[0])
    alone = wait_until(
        lambda: (s := try_state(cluster.groups[0].worker_urls[0])) and s["num_participants"] == 1
        and s["commits"] >= before["commits"] + 5 and s,
        60, what="group 0 to keep committing alone")
    assert alone["step"] > before["step"]

    cluster.start_group(1)
    cluster.wait_for_workers(1)

    def rejoined():
        s = states(cluster, [0, 1])
        if not s or any(x["num_participants"] != 2 for x in s):
            return None
        return s if s[1]["heals"] >= 1 and abs(s[0]["step"] - s[1]["step"]) <= 2 else None

    s0, s1 = wait_until(rejoined, 90, what="group 1 to heal and rejoin")
    assert s1["step"] >= alone["step"], "the restarted group continues at the quorum's step"
    assert s1["commits"] < s1["step"], "it did not train the earlier steps itself: it healed"


@pytest.fixture
def hung_cluster(tmp_path):
    # Three groups: the Lighthouse forms a quorum only from more than half of the heartbeating
    # groups, and a hung group keeps heartbeating, so with two the survivor would wait forever.
    c = LocalCluster(tmp_path, num_groups=3, steps=100_000, pg_timeout_s=5,
                     join_timeout_ms=3000, step_pause_s=0.02)
    try:
        c.start(faults={1: ["hang:at_step=8"]})
        yield c
    finally:
        c.stop()


def test_hang_stacks_answer_fast_and_survivor_moves_on(hung_cluster):
    c = hung_cluster
    hung_url, peer_url = c.groups[1].worker_urls[0], c.groups[0].worker_urls[0]
    wait_until(lambda: (s := try_state(peer_url)) and s["phase"] == "allreduce"
               and time.time() - s["phase_since"] > 1.0, 60,
               what="the peer to wait in its all_reduce")
    t0 = time.monotonic()
    hung = requests.get(hung_url + "/v1/stacks", timeout=1).text
    t1 = time.monotonic()
    peer = requests.get(peer_url + "/v1/stacks", timeout=1).text
    t2 = time.monotonic()
    assert t1 - t0 < 1.0 and t2 - t1 < 1.0
    assert "before_allreduce" in hung and "faults.py" in hung  # blocked by the injected hang
    assert "loop.py" in peer and ".wait()" in peer  # waiting on its collective
    hung_state = try_state(hung_url)
    assert hung_state["phase"] == "backward" and hung_state["step"] == 8

    # Survivors survive: the peer's collective times out, the next quorum leaves the hung
    # group out (it heartbeats but never asks), and the peer commits again alone.
    resumed = wait_until(lambda: (s := try_state(peer_url)) and s["num_participants"] == 2
                         and s["step"] > 9 and s, 60, what="the survivors to commit again")
    assert resumed["quorum_id"] > hung_state["quorum_id"], "a new quorum without the hung group"
    assert c.groups[0].alive() and c.groups[2].alive()


def test_two_ranks_per_group_fsdp2_inside_heals_across_groups(tmp_path):
    """FT-HSDP: torchrun runs 2 ranks per group (FSDP2 inside), groups average across."""
    c = LocalCluster(tmp_path, num_groups=2, ranks_per_group=2, steps=100_000, pg_timeout_s=10)

    def all_states():
        s = [try_state(u) for u in c.worker_urls()]
        return s if s and all(s) else None

    try:
        c.start()
        wait_until(lambda: (s := all_states()) and len(s) == 4 and all(
            x["step"] >= 5 and x["num_participants"] == 2 for x in s), 120,
            what="4 ranks training in one quorum")
        dump = get_json(c.groups[0].worker_urls[1] + "/v1/fr_trace", 5)
        inc = dump["incarnations"][-1]
        assert inc["group_rank"] == 1 and inc["global_ranks"] == [1, 3]
        names = {(e["process_group"][0], e["profiling_name"]) for e in dump["entries"]}
        assert ("", "gloo:all_reduce") in names  # across groups (torchft)
        assert any(n.startswith("gloo:all_gather") for _, n in names)  # FSDP2 inside the group

        c.kill_group(1)  # torchrun and both its workers, found by PID
        c.start_group(1)
        c.wait_for_workers(1)
        healed = wait_until(lambda: (s := all_states()) and len(s) == 4 and all(
            x["num_participants"] == 2 for x in s) and s, 120, what="group 1 to heal")
        by_rank = {x["rank"]: x for x in healed}
        assert by_rank[2]["heals"] == 1 and by_rank[3]["heals"] == 1
        assert by_rank[2]["commits"] < by_rank[0]["commits"]
    finally:
        c.stop()
