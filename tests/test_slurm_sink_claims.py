"""The ``slurm`` sink against a REAL loopback Slurm controller (tests/test_hosts_sinks.py's
fixture: nodes ``n1``, ``n2``; root only): two shards of one job each hold their own entry in a
node's drain, a monitor left at the default ``--job`` with a per-job sink is warned, and a
release that leaves a node DOWN with the drain's reason says so."""

from __future__ import annotations

import logging
import subprocess

from monitor.act.sinks.hooks import SlurmSink
from monitor.cli import warn_about_tokens
from monitor.config import MonitorConfig, QuarantineConfig
from tests import test_hosts_sinks
from tests.test_slurm_sink_jobs import node

slurm, slurm_cluster = test_hosts_sinks.slurm, test_hosts_sinks.slurm_cluster
EVENT = {**test_hosts_sinks.EVENT, "node": "n2", "job": "train"}


def shard(i: int | None, op: str = "quarantine") -> dict:
    return {**EVENT, "event": op, "finding": {"id": 10 + (i or 0), "replica_group": i or 0},
            "monitor": {"id": f"m{i}", "host": "h", "shard": None if i is None else f"{i}/2"}}


def test_shards_of_one_job_each_hold_their_own_drain(slurm, monkeypatch):
    """Shards 0 and 1 of job ``train`` (one ledger each) quarantine n2: shard 0's release
    leaves shard 1's drain; shard 1's undrains n2. A drain an older version wrote for the job
    alone (unsharded) is still released by a shard of that job."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sink = SlurmSink()
    for i in (0, 1):
        assert sink.quarantine(shard(i)).ok
    assert node("n2") == (True, "lightkeeper(train/shard0,train/shard1): "
                                "dead_rank finding 11 replica_group 1")
    res = sink.release(shard(0, "release"))
    assert res.ok, res.detail
    assert node("n2") == (True, "lightkeeper(train/shard1): still quarantined by train/shard1")
    again = sink.release(shard(0, "release"))  # released already: shard 1's drain is kept
    assert again.ok and again.detail == ("node n2 drained by train/shard1, not by job train "
                                         "shard 0: left as it is"), again.detail
    last = sink.release(shard(1, "release"))
    assert last.detail == "scontrol update NodeName=n2 State=UNDRAIN exited 0", last.detail
    assert node("n2") == (False, "")
    assert sink.quarantine(shard(None)).ok  # an older version's, or an unsharded monitor's
    assert node("n2")[1].startswith("lightkeeper(train): ")
    assert sink.release(shard(1, "release")).ok
    assert node("n2") == (False, "")


def test_a_per_job_sink_under_the_default_job_is_warned_at_start_up(caplog):
    with caplog.at_level(logging.WARNING):
        for actions in ((), ("exec:true",)):
            warn_about_tokens(MonitorConfig(quarantine=QuarantineConfig(actions=actions)))
        warn_about_tokens(MonitorConfig(job="train", quarantine=QuarantineConfig(
            actions=("slurm",))))
        assert caplog.messages == []
        for a in ("slurm", "k8s"):
            warn_about_tokens(MonitorConfig(quarantine=QuarantineConfig(actions=(a,))))
    assert caplog.messages == 2 * [
        "--action slurm/k8s with the default --job lightkeeper: another job's monitor left at "
        "it shares this one's drain or taint, and its release lifts both; name the job "
        "(docs/quarantine.md)"]


def test_a_release_leaving_the_node_down_with_the_drains_reason_says_so(slurm, monkeypatch):
    """The host dropped off: drained, then Slurm set it DOWN (after SlurmdTimeout), keeping the
    drain's reason, which ReturnToService=1 never returns (only "Not responding"). The release
    undrains it and is done, but resumes nothing: whether the host is healthy (it may have
    rebooted, which Slurm's own reason would keep DOWN) is unknown, so the detail says how."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sink = SlurmSink()
    ev = {**EVENT, "kind": "dead"}
    assert sink.quarantine(ev).ok
    reason = node("n2")[1]
    # Slurm's own DOWN of a drained node, as it leaves it (its reason kept)
    subprocess.run(["scontrol", "update", "NodeName=n2", "State=DOWN", f"Reason={reason}"],
                   check=True)
    res = sink.release({**ev, "event": "release"})
    assert res.ok and res.detail == (
        "scontrol update NodeName=n2 State=UNDRAIN exited 0; node n2 still DOWN with this "
        "reason, which Slurm's ReturnToService=1 never returns: once it is healthy, scontrol "
        "update NodeName=n2 State=RESUME"), res.detail
    shown = subprocess.run(["scontrol", "show", "node", "n2"], capture_output=True, text=True,
                           check=True).stdout
    assert shown.split("State=")[1].split()[0].split("+")[0] == "DOWN", shown
    assert node("n2") == (False, reason)
