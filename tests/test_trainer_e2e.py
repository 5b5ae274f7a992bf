"""The trainer and its WorkerServers with real parts: torchft's Lighthouse, gloo process groups,
one process per replica group. Timeouts are short so failures show within seconds."""

from __future__ import annotations

import subprocess

import pytest
import requests

from lightkeeper.cluster import LocalCluster, wait_until
from tests.conftest import require_binary
from tests.support.workers import analyze_cli, get_json, save_dumps, torchft_entries, try_state

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
    # A group that joined late healed to the quorum's step, so count commits, not steps.
    assert all(x["commits"] > y["commits"] for x, y in zip(later, (s0, s1), strict=True))
    assert later[0]["quorum_id"] == later[1]["quorum_id"]
    assert later[0]["replica_id"].startswith("replica_group_0:")
    assert later[1]["replica_id"].startswith("replica_group_1:")

    def current_collectives():
        """Both groups' dumps, once the current quorum has 10+ all_reduces on both."""
        dumps = [get_json(cluster.groups[g].worker_urls[0] + "/v1/fr_trace", 5) for g in (0, 1)]
        quorum = dumps[0]["incarnations"][-1]["quorum_id"]
        incs = [next((i for i in d["incarnations"] if i["quorum_id"] == quorum), None)
                for d in dumps]
        if None in incs:
            return None
        seqs = [{e["collective_seq_id"]: e for e in torchft_entries(d, inc)}
                for d, inc in zip(dumps, incs, strict=True)]
        return (incs, seqs) if len(set(seqs[0]) & set(seqs[1])) >= 10 else None

    # A group that joined late makes a new quorum (sequence ids restart): wait for 10 steps in it.
    incs, seqs = wait_until(current_collectives, 60, interval=0.5,
                            what="10 collectives of the current quorum on both groups")
    assert sorted(i["replica_rank"] for i in incs) == [0, 1]
    assert all(i["global_ranks"] == [0, 1] for i in incs)
    for by_seq in seqs:
        assert all(e["profiling_name"] == "gloo:all_reduce" for e in by_seq.values())
    common = set(seqs[0]) & set(seqs[1])
    assert all(seqs[0][k]["input_sizes"] == seqs[1][k]["input_sizes"] for k in common)


def test_analyze_finds_nothing_in_a_healthy_trainers_dumps(cluster, tmp_path):
    urls = [cluster.groups[g].worker_urls[0] for g in (0, 1)]
    wait_until(lambda: all((s := try_state(u)) and s["step"] >= 10 for u in urls), 120,
               what="10 steps")
    status, report = analyze_cli(*save_dumps(urls, tmp_path))
    assert status == 0, report
    assert report["ranks"] == [0, 1] and report["findings"] == [] and report["errors"] == []


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
