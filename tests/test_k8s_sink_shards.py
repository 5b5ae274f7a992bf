"""The ``k8s`` sink keeps each shard's quarantine of a node apart: shards of one job (``--shard
I/N``, one ledger each) hold a taint each, so one's release leaves another's taint, cordon and
condition; a slice's holder and standby share theirs. Against the FAKE API server of
tests/test_hosts_sinks.py (none can run here)."""

from __future__ import annotations

import re

from monitor.act.sinks.kubernetes import taint_key
from tests import test_hosts_sinks

kube = test_hosts_sinks.kube
EVENT = {**test_hosts_sinks.EVENT, "job": "train"}
JOB_POD = {**test_hosts_sinks.FakeKubeAPI.JOB_POD, "lightkeeper/job": "train"}
# a taint key: a DNS-subdomain prefix, then a name of at most 63 characters
QUALIFIED = re.compile(r"[a-z0-9.-]{1,253}/[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")


def shard(i: int | None, op: str = "quarantine", monitor: str = "") -> dict:
    return {**EVENT, "event": op, "finding": {"id": 10 + (i or 0), "replica_group": i or 0},
            "monitor": {"id": monitor or f"m{i}", "host": "h",
                        "shard": None if i is None else f"{i}/2"}}


def state(api) -> tuple[list[str], bool, tuple[str, str]]:
    """The node's quarantine taints, whether it is cordoned, and its condition."""
    keys = [t["key"] for t in api.node["spec"]["taints"] if t["key"].startswith("lightkeeper")]
    (c,) = [c for c in api.node["status"]["conditions"] if c["type"] == "LightkeeperQuarantined"]
    return keys, api.node["spec"].get("unschedulable"), (c["status"], c["reason"])


def test_shards_of_one_job_each_hold_their_own_taint(kube):
    """Shards 0 and 1 of job ``train`` quarantine the node: shard 0's release leaves shard 1's
    taint, the cordon and a True condition; shard 1's standby (another monitor, same shard)
    releases the node. A whole-job taint an older version wrote is still lifted by a shard."""
    api, rx, sink = kube
    api.pods = {"train-0": ("node-1", JOB_POD)}
    for i in (0, 1):
        assert sink.quarantine(shard(i)).ok
    assert state(api)[1:] == (True, ("True", "DeadRank"))
    res = sink.release(shard(0, "release"))
    s0, s1 = "lightkeeper.io/quarantined.shard0-train", "lightkeeper.io/quarantined.shard1-train"
    assert state(api) == ([s1], True, ("True", "Quarantined"))
    assert res.ok and res.detail == f"node node-1: taint removed; still quarantined by {s1}", res
    res = sink.release(shard(0, "release"))  # released already: shard 1's taint is kept
    assert res.ok and res.detail == f"node node-1: no {s0} taint, nothing to release", res
    assert state(api) == ([s1], True, ("True", "Quarantined"))
    assert sink.release(shard(1, "release", monitor="standby-of-1")).ok
    assert state(api) == ([], False, ("False", "Released"))
    assert "lightkeeper.io/cordoned" not in api.node["metadata"]["annotations"]

    assert sink.quarantine(shard(None)).ok  # an older version's, or an unsharded monitor's
    assert sink.quarantine(shard(0)).ok
    assert state(api)[0] == ["lightkeeper.io/quarantined-train", s0]
    assert sink.release(shard(0, "release")).ok  # its own first: the job's taint holds on
    assert state(api) == (["lightkeeper.io/quarantined-train"], True, ("True", "Quarantined"))
    assert sink.release(shard(1, "release")).ok  # no taint of its own: the job's is lifted
    assert state(api) == ([], False, ("False", "Released"))


def test_a_shards_taint_key_is_valid_and_no_jobs_name_makes_it():
    """``train.shard0`` or ``train/shard0`` run unsharded is another job than shard 0 of
    ``train``; a long name still fits a taint key's 63 characters."""
    keys = [taint_key("train", "0"), taint_key("train.shard0"), taint_key("train/shard0"),
            taint_key("train_shard0"), taint_key("train", "1"), taint_key("train"),
            taint_key("x" * 60, "12"), taint_key("x" * 60 + "y", "12"), taint_key("x" * 60)]
    assert len(set(keys)) == len(keys), keys
    assert keys[0] == "lightkeeper.io/quarantined.shard0-train", keys
    assert all(QUALIFIED.fullmatch(k) for k in keys), keys
