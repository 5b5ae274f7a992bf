"""The ``k8s`` sink keeps each shard's quarantine of a node apart: shards of one job (``--shard
I/N``, one ledger each) hold a taint each, so one's release leaves another's taint, cordon and
condition; a slice's holder and standby share theirs; the shard that quarantined, kept with
the host, keys its release. Against the FAKE API server of
tests/test_hosts_sinks.py (none can run here)."""

from __future__ import annotations

import logging
import re

from monitor.act.host_actions import monitor_identity
from monitor.act.hosts import HostLedger
from monitor.act.sinks.kubernetes import taint_key
from monitor.config import QuarantineConfig
from monitor.store import Store
from tests import test_hosts_sinks
from tests.test_hosts import Clock, finding

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
    assert res.ok and res.detail == (
        f"node node-1: no {s0} taint, nothing to release; job train's {s1}, set under another "
        "--shard, holds it: only that shard's release lifts it (see docs/quarantine.md)"), res
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


def test_a_release_lifts_the_taint_of_the_shard_that_quarantined(kube, tmp_path):
    """A shard's ``--state`` kept across a ``--shards`` change (back to one unsharded monitor):
    the release lifts the taint its quarantine set, ``quarantined.shard0-train``, whatever
    shard the running monitor has."""
    api, rx, sink = kube
    api.pods = {"train-0": ("node-1", JOB_POD)}
    clock = Clock()

    def ledger(sender_shard: str | None) -> HostLedger:
        led = HostLedger(Store(str(tmp_path / "m.sqlite")), QuarantineConfig(), [sink], "train",
                         clock)
        led.sender = monitor_identity("m", sender_shard)
        return led

    f = finding("hang", "h1", 1)
    f["evidence"]["culprits"][0]["node"] = "node-1"
    a = ledger("0/2")
    a.record([f], clock())
    a.decide(clock(), None, 10)
    a.run_actions(clock())
    assert state(api) == (["lightkeeper.io/quarantined.shard0-train"], True, ("True", "Hang"))
    a.store.close()
    clock.t += 60
    b = ledger(None)
    b.release("h1", "repaired")
    b.run_actions(clock())
    (h,) = b.to_json(clock())
    assert (h["state"], h["last_action"]["status"], h["last_action"]["detail"]) == (
        "released", "done", "node node-1: condition LightkeeperQuarantined=False; taint removed")
    assert state(api) == ([], False, ("False", "Released"))
    b.store.close()


def test_a_release_finding_only_another_shards_taint_says_so(kube, caplog):
    """The event's recorded shard keys the taint, not its sender's; an event an older version
    queued (no ``shard``) has its sender's. A release whose own taint is gone while another
    shard index's taint of its job holds the node says so, in its detail and the log."""
    api, rx, sink = kube
    api.pods = {"train-0": ("node-1", JOB_POD)}
    s1 = "lightkeeper.io/quarantined.shard1-train"
    assert sink.quarantine({**shard(0), "shard": "1/2"}).ok  # a shard-1 quarantine, sent by 0
    assert state(api)[0] == [s1]
    with caplog.at_level(logging.WARNING, logger="monitor.act.sinks.kubernetes"):
        res = sink.release({**shard(1, "release"), "shard": None})  # an unsharded quarantine's
    assert res.ok and res.detail == (
        "node node-1: no lightkeeper.io/quarantined-train taint, nothing to release; job train's "
        f"{s1}, set under another --shard, holds it: only that shard's release lifts it (see "
        "docs/quarantine.md)"), res.detail
    assert [r.getMessage() for r in caplog.records] == [
        f"node node-1: job train's {s1}, set under another --shard, holds it: only that "
        "shard's release lifts it; if no monitor runs it, lift it by hand (docs/quarantine.md)"]
    assert state(api) == ([s1], True, ("True", "DeadRank"))
    assert sink.release({**shard(0, "release"), "shard": "1/2"}).ok
    assert state(api) == ([], False, ("False", "Released"))
