"""The ``slurm`` sink against a REAL loopback Slurm controller (tests/test_hosts_sinks.py's
fixture: nodes ``n1``, ``n2``; root only): a node that runs none of the ranks' Slurm jobs is
never drained, but one whose job just ended there, a heterogeneous job's part there, or a job
requeued from it (retried) still is, two shards of one job each hold their own entry in a
node's drain (the shard that quarantined, kept with the host, keys its release), a monitor left at the default ``--job`` with a per-job sink is warned, and a
release that leaves a node DOWN with the drain's reason says so."""

from __future__ import annotations

import logging
import os
import subprocess
import time

from monitor.act.host_actions import monitor_identity
from monitor.act.hosts import HostLedger
from monitor.act.sinks.hooks import SlurmSink
from monitor.cli import warn_about_tokens
from monitor.config import MonitorConfig, QuarantineConfig
from monitor.store import Store
from tests import test_hosts_sinks
from tests.test_hosts import Clock, finding
from tests.test_hosts_sinks import SLURM_JOBS, _jobs, _nodes, _until_nodes_idle
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
    assert again.ok and again.detail == (
        "node n2 drained by train/shard1, not by job train shard 0: left as it is; "
        "train/shard1, job train's under another --shard, is only that shard's release to "
        "lift (see docs/quarantine.md)"), again.detail
    last = sink.release(shard(1, "release"))
    assert last.detail == "scontrol update NodeName=n2 State=UNDRAIN exited 0", last.detail
    assert node("n2") == (False, "")
    assert sink.quarantine(shard(None)).ok  # an older version's, or an unsharded monitor's
    assert node("n2")[1].startswith("lightkeeper(train): ")
    assert sink.release(shard(1, "release")).ok
    assert node("n2") == (False, "")


def test_a_release_takes_off_the_entry_of_the_shard_that_quarantined(slurm, monkeypatch,
                                                                     tmp_path):
    """A shard's ``--state`` kept across a ``--shards`` change (back to one unsharded monitor):
    the release takes off the entry its quarantine listed, ``train/shard0``, whatever shard
    the running monitor has; a release never sent before the change is keyed on it too."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    clock = Clock()

    def ledger(sender_shard: str | None) -> HostLedger:
        led = HostLedger(Store(str(tmp_path / "m.sqlite")), QuarantineConfig(), [SlurmSink()],
                         "train", clock)
        led.sender = monitor_identity("m", sender_shard)
        return led

    for host, sender in (("h1", None), ("h2", "1/3")):
        f = finding("hang", host, 1)
        f["evidence"]["culprits"][0].update(node="n2", slurm_job_id=SLURM_JOBS[0])
        a = ledger("0/2")
        a.record([f], clock())
        a.decide(clock(), None, 10)
        a.run_actions(clock())
        assert node("n2") == (True, "lightkeeper(train/shard0): hang finding 1 replica_group 1")
        if host == "h2":  # released, but sent only by the next run
            a.release(host, "repaired")
        a.store.close()
        clock.t += 60
        b = ledger(sender)
        if host == "h1":
            b.release(host, "repaired")
        b.run_actions(clock())
        (h,) = [h for h in b.to_json(clock()) if h["host"] == host]
        assert (h["state"], h["last_action"]["op"], h["last_action"]["status"],
                h["last_action"]["detail"]) == (
            "released", "release", "done", "scontrol update NodeName=n2 State=UNDRAIN exited 0")
        assert node("n2") == (False, "")
        b.store.close()


def test_a_release_finding_only_another_shards_entry_says_so(slurm, monkeypatch, caplog):
    """The event's recorded shard keys the entry, not its sender's; an event an older version
    queued (no ``shard``) has its sender's. A release whose own entry is gone while another
    shard index's entry of its job holds the node says so, in its detail and the log."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sink = SlurmSink()
    assert sink.quarantine({**shard(0), "shard": "1/2"}).ok  # a shard-1 quarantine, sent by 0
    assert node("n2")[1].startswith("lightkeeper(train/shard1): ")
    with caplog.at_level(logging.WARNING, logger="monitor.act.sinks.hooks"):
        res = sink.release({**shard(1, "release"), "shard": None})  # an unsharded quarantine's
    assert res.ok and res.detail == (
        "node n2 drained by train/shard1, not by job train: left as it is; train/shard1, job "
        "train's under another --shard, is only that shard's release to lift (see "
        "docs/quarantine.md)"), res.detail
    assert [r.getMessage() for r in caplog.records] == [
        "node n2: job train's train/shard1, listed under another --shard, keeps it drained: "
        "only that shard's release lifts it; if no monitor runs it, lift it by hand "
        "(docs/quarantine.md)"]
    assert node("n2")[0]
    assert sink.release({**shard(0, "release"), "shard": "1/2"}).ok
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
    # the job ended first: the DOWN killing it gets slurmd to register again, which
    # ReturnToService=2 returns at once
    subprocess.run(["scancel", *_jobs(slurm)], check=True)
    deadline = time.monotonic() + 15
    while _jobs(slurm):
        assert time.monotonic() < deadline, _jobs(slurm)
        time.sleep(0.1)  # polling the controller, with a deadline
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


def _sbatch(env: dict, node: str, *user: str, wrap: str = "exec sleep 900",
            opts: tuple = ()) -> str:
    r = subprocess.run([*user, "sbatch", "--parsable", "-w", node, "-t", "15", "-D", "/",
                        "-o", "/dev/null", *opts, "--wrap", wrap], env=env,
                       capture_output=True, text=True, check=True)
    return r.stdout.strip().split(";")[0]


def _free_nodes(env: dict) -> None:
    subprocess.run(["scancel", *_jobs(env)], check=True)
    _until_nodes_idle(env, time.monotonic() + 15, "the Slurm nodes were not IDLE again")


def _until_job(job: str, shown: str) -> None:
    """Until ``squeue -t all`` shows ``job`` as ``STATE NODES``."""
    deadline = time.monotonic() + 15
    while (now := subprocess.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%T %N"],
                                 capture_output=True, text=True).stdout.strip()) != shown:
        assert time.monotonic() < deadline, f"job {job}: {now!r}, not {shown!r}"
        time.sleep(0.1)  # polling the controller, with a deadline


def _stand_in_squeue(slurm, monkeypatch, tmp_path, cases: str) -> None:
    """The cluster's environment with ``squeue`` a stand-in: a shell ``case`` on its arguments."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "squeue").write_text(f'#!/bin/sh\ncase "$*" in {cases} esac\n')
    (tmp_path / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_a_heterogeneous_jobs_part_holds_its_node_under_the_first_parts_id(slurm, monkeypatch,
                                                                          tmp_path):
    """A heterogeneous job 14's part 1, job 15 to Slurm, runs on n2; its ranks' SLURM_JOB_ID is
    the first part's 14: n2 is drained. squeue is a stand-in answering as Slurm 22.05 does for
    such a part (``%A`` 15, ``%i`` 14+1): the loopback cluster starts a hetjob only in its
    backfill pass, up to 30 s later."""
    _stand_in_squeue(slurm, monkeypatch, tmp_path,
                     '*%i*) echo "15 14+1 RUNNING n2" ;; *) echo 15 ;;')
    sink = SlurmSink()
    res = sink.quarantine({**EVENT, "kind": "hang", "slurm_jobs": ["14"]})
    assert res.ok, res.detail
    assert node("n2") == (True, "lightkeeper(train): hang finding 7 replica_group 2")
    assert sink.release({**EVENT, "event": "release"}).ok and node("n2") == (False, "")


def test_a_job_requeued_held_by_its_own_exit_code_is_retried(slurm, monkeypatch, tmp_path):
    """A batch job requeued and held by its exit code (``SPECIAL_EXIT``, on no node): it may run
    on that node again, so the drain is retried, not refused. squeue is a stand-in: the
    loopback cluster has no job that exits so."""
    _stand_in_squeue(slurm, monkeypatch, tmp_path, '*--jobs*) echo "14 14 SPECIAL_EXIT " ;;')
    res = SlurmSink().quarantine({**EVENT, "kind": "hang", "slurm_jobs": ["14"]})
    assert (res.ok, res.retry) == (False, True), res.detail
    assert "SPECIAL_EXIT" in res.detail and node("n2") == (False, "")


def test_a_job_that_ended_on_the_node_a_moment_ago_still_holds_it(slurm, monkeypatch):
    """The ranks' job ended just before the drain: on n1 its rank died (FAILED), on n2 its node
    failed (DOWN, the job NODE_FAIL, not requeued). Slurm lists each there for MinJobAge: both
    nodes are drained."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    _free_nodes(slurm)
    died = _sbatch(slurm, "n1", wrap="exit 1")
    failed = _sbatch(slurm, "n2", opts=("--no-requeue",))
    _until_job(died, "FAILED n1")
    _until_job(failed, "RUNNING n2")
    subprocess.run(["scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=Not responding"],
                   check=True)
    _until_job(failed, "NODE_FAIL n2")
    sink = SlurmSink()
    for name, job in (("n1", died), ("n2", failed)):
        res = sink.quarantine({**EVENT, "node": name, "slurm_jobs": [job]})
        assert res.ok, res.detail
        assert node(name) == (True, "lightkeeper(train): dead_rank finding 7 replica_group 2")


def test_a_requeued_job_is_retried_and_a_job_gone_from_a_down_node_said(slurm, monkeypatch):
    """The ranks' batch job on n2, requeued when its node failed (Slurm's JobRequeue): PENDING
    on no node, it may run there again, so the drain is retried, not refused for good. Once it
    is gone (cancelled) and the node DOWN again, the drain is refused for good, the detail
    saying what Slurm shows and that a job of ours that left it is the operator's to drain."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    _free_nodes(slurm)
    ours = _sbatch(slurm, "n2")
    _until_job(ours, "RUNNING n2")
    down = ["scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=Not responding"]
    subprocess.run(down, check=True)
    _until_job(ours, "PENDING")
    sink = SlurmSink()
    res = sink.quarantine({**EVENT, "slurm_jobs": [ours, "99999"]})
    assert (res.ok, res.retry, res.detail) == (
        False, True, f"node n2 runs no job {','.join(sorted([ours, '99999']))} of this job now, "
                     f"Slurm shows job {ours} PENDING on no node: retried while it waits")
    subprocess.run(["scancel", ours], check=True)
    _until_job(ours, "CANCELLED")
    # the DOWN killing the job got slurmd to register again, which ReturnToService=2 returned
    deadline = time.monotonic() + 15
    while _nodes(slurm)["n2"].startswith("DOWN"):
        assert time.monotonic() < deadline, _nodes(slurm)
        time.sleep(0.1)  # polling the controller, with a deadline
    subprocess.run(down, check=True)  # the host dropped off again, with no job on it
    res = sink.quarantine({**EVENT, "slurm_jobs": [ours]})
    assert (res.ok, res.retry, res.detail) == (
        False, False, f"node n2 (DOWN: Not responding) runs no job {ours} of this job, Slurm "
                      f"shows job {ours} CANCELLED on no node: claim not verified; if the job "
                      "ran there, drain it by hand")
    assert not node("n2")[0]


def test_a_node_that_runs_no_job_of_the_ranks_is_never_drained(slurm, monkeypatch, tmp_path):
    """The ranks' Slurm job runs on n1, user nobody's alone on n2. A rank claiming n2 (a misset
    NODE_NAME, or another cluster's ``n2.siteb`` by its first label) or reporting no job gets
    no drain: refused for good. Its own node n1 is drained; a squeue that cannot reach the
    controller is retried; a release needs no job."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    _free_nodes(slurm)
    ours, theirs = _sbatch(slurm, "n1"), _sbatch(slurm, "n2", "runuser", "-u", "nobody", "--")
    deadline = time.monotonic() + 15
    while _jobs(slurm) != {ours: "RUNNING n1", theirs: "RUNNING n2"}:
        assert time.monotonic() < deadline, _jobs(slurm)
        time.sleep(0.1)  # polling the controller, with a deadline
    sink = SlurmSink()
    ev = {**EVENT, "kind": "hang", "slurm_jobs": [ours]}
    for claim in ("n2", "n2.siteb"):
        res = sink.quarantine({**ev, "node": claim})
        assert (res.ok, res.retry) == (False, False), res
        assert res.detail == (f"node n2 runs no job {ours} of this job, Slurm shows job {ours} "
                              "RUNNING on n1: claim not verified; if the job ran there, drain it "
                              "by hand")
    res = sink.quarantine({**ev, "node": "n2", "slurm_jobs": ["99999", "1;x"]})
    assert (res.ok, res.retry, res.detail) == (
        False, False, "node n2 runs no job 1;x,99999 of this job, unknown to Slurm: claim not "
                      "verified")
    res = sink.quarantine({**ev, "node": "n1", "slurm_jobs": []})
    assert (res.ok, res.retry, res.detail) == (
        False, False, "node n1 runs no job (none reported) of this job: claim not verified")
    assert node("n1") == node("n2") == (False, "")
    # the controller unreachable to squeue alone: retried, nothing drained
    (tmp_path / "squeue").write_text("#!/bin/sh\necho 'squeue: error: Socket timed out' >&2\n"
                                     "exit 1\n")
    (tmp_path / "squeue").chmod(0o755)
    with monkeypatch.context() as m:
        m.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        res = sink.quarantine({**ev, "node": "n1"})
    assert not res.ok and res.retry and res.detail.startswith(
        "cannot read the node's jobs: squeue -h -t all -w n1 -o %A %i %T %N exited 1")
    assert node("n1") == (False, "")
    res = sink.quarantine({**ev, "node": "n1"})
    assert res.ok, res.detail
    assert node("n1") == (True, "lightkeeper(train): hang finding 7 replica_group 2")
    res = sink.release({**ev, "event": "release", "node": "n1", "slurm_jobs": []})
    assert res.ok and node("n1") == (False, ""), res.detail
