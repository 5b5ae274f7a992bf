"""The ``slurm`` sink against a REAL loopback Slurm controller (tests/test_hosts_sinks.py's
fixture: nodes ``n1``, ``n2``; root only): the release of a node Slurm does not know, and two
jobs' monitors writing one node's drain at the same time, a node named by its NodeHostname
(and an older version's drain through one, never through a NodeAddr, a NodeHostname several
nodes carry or one whose quarantine was not done) and a release by a job the drain does not
list."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading

from monitor.act.hosts import HostLedger
from monitor.act.sinks import ActionResult
from monitor.act.sinks.hooks import SlurmSink
from monitor.config import QuarantineConfig
from monitor.store import Store
from tests import test_hosts_sinks
from tests.test_hosts import Clock, finding

slurm, slurm_cluster = test_hosts_sinks.slurm, test_hosts_sinks.slurm_cluster
EVENT = test_hosts_sinks.EVENT
UNKNOWN = ("node {} unknown to Slurm by that name or its first label; give the ranks "
           "NODE_NAME=$SLURMD_NODENAME")


def node(name: str) -> tuple[bool, str]:
    out = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True,
                         check=True).stdout
    return ("DRAIN" in out.split("State=")[1].split()[0],
            out.split("Reason=")[1].splitlines()[0].rsplit(" [", 1)[0] if "Reason=" in out
            else "")


def test_a_release_of_a_node_slurm_does_not_know_is_done(slurm, monkeypatch):
    """A rank claimed a node Slurm knows by neither name: its quarantine fails for good, and
    the release has nothing to undo: done (as the k8s sink's release of a deleted node), so
    the host's failed action can be cleared."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sink = SlurmSink()
    for name in ("n9", "n9.cluster.local"):
        bad = sink.quarantine({**EVENT, "node": name})
        assert not bad.ok and not bad.retry and bad.detail == UNKNOWN.format(name), bad.detail
        res = sink.release({**EVENT, "event": "release", "node": name})
        assert res.ok and res.detail == f"node {name} unknown to Slurm, nothing to release", \
            res.detail
    assert node("n1") == node("n2") == (False, "")


def test_two_jobs_quarantining_one_node_at_once_both_keep_their_quarantine(
        slurm, monkeypatch, tmp_path):
    """Jobs a and b read n1 undrained, then both write their drain: the second write drops
    the first job's entry. The job whose entry is gone sees it when it reads the node again:
    its attempt fails, retried, and the retry lists both; b's release then leaves a's drain."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    real = shutil.which("scontrol")
    gate = tmp_path / "gate"
    gate.mkdir()
    # the real scontrol, whose updates wait for each other (both read the node before either
    # writes) and answer once both are written (neither reads the node in between)
    wrapper = tmp_path / "bin" / "scontrol"
    wrapper.parent.mkdir()
    wrapper.write_text(f'''#!/bin/sh
G={gate}
both() {{ n=0; until [ "$(ls $G | grep -c "^$1")" -ge 2 ]; do
  n=$((n+1)); [ $n -gt 500 ] && exit 9; sleep 0.02; done; }}
if [ "$1" = update ] && [ -e $G/on ]; then
  touch $G/in.$$; both in
  {real} "$@"; rc=$?
  touch $G/out.$$; both out
  exit $rc
fi
exec {real} "$@"
''')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    (gate / "on").touch()
    sink = SlurmSink()
    ev = {j: {**EVENT, "node": "n1", "job": j, "finding": {"id": i, "replica_group": i}}
          for i, j in enumerate(("a", "b"))}
    res = {}
    threads = [threading.Thread(target=lambda j=j: res.__setitem__(j, sink.quarantine(ev[j])))
               for j in ev]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (gate / "on").unlink()
    lost = [j for j, r in res.items() if not r.ok]
    assert len(lost) == 1, {j: r.detail for j, r in res.items()}
    r = res[lost[0]]
    assert r.retry and r.detail.startswith("node n1 changed meanwhile"), r.detail
    again = sink.quarantine(ev[lost[0]])  # the action thread's retry
    assert again.ok, again.detail
    drained, reason = node("n1")
    assert drained and reason.startswith("lightkeeper(a,b): "), reason
    assert sink.release({**ev["b"], "event": "release"}).ok
    assert node("n1") == (True, "lightkeeper(a): still quarantined by a")
    assert sink.release({**ev["a"], "event": "release"}).ok
    assert node("n1") == (False, "")


def test_a_node_named_by_its_node_hostname_is_never_updated(slurm, monkeypatch):
    """The fixture's nodes have ``NodeHostname=localhost``: ``show node localhost`` finds none,
    yet ``update NodeName=localhost`` drains n1. The quarantine sends no update (its read-back
    could never find the node: retried for ever, an operator's reason rewritten each time, and
    the release would leave n1 drained): it fails for good, saying how to name the node."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sink = SlurmSink()
    alias = {**EVENT, "node": "localhost"}
    for held in ("", "operator: bad DIMM"):
        if held:
            subprocess.run(["scontrol", "update", "NodeName=n1", "State=DRAIN",
                            f"Reason={held}"], check=True)
        res = sink.quarantine(alias)
        assert not res.ok and not res.retry and res.detail == UNKNOWN.format("localhost"), \
            res.detail
        assert node("n1") == (bool(held), held) and node("n2") == (False, "")
        res = sink.release({**alias, "event": "release"})
        assert res.ok and res.detail == "node localhost unknown to Slurm, nothing to release"
        assert node("n1") == (bool(held), held)


def test_an_older_versions_drain_through_a_node_hostname_is_released(slurm, monkeypatch):
    """An older version quarantined node ``localhost`` with ``update NodeName=localhost``,
    which drained n1 (its NodeHostname); ``show node localhost`` finds none. The release finds
    n1 by its NodeHostName and a Lightkeeper reason listing the job, or no job, and takes the
    job off as usual (the others' kept); a drain by another job or an operator is left."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    # the fixture's nodes share NodeHostname localhost: only n1 carries it here
    subprocess.run(["scontrol", "update", "NodeName=n2", "NodeHostname=n2host"], check=True)
    sink = SlurmSink()
    # as the monitor sends it: the quarantine it undoes was done (the older version's update)
    release = {**EVENT, "event": "release", "node": "localhost", "job": "a",
               "undoes": {"action_id": 1, "status": "done"}}
    why = "dead_rank finding 9 replica_group 1"
    for reason, after in ((f"lightkeeper(a): {why}", (False, "")),
                          (f"lightkeeper: {why}", (False, "")),
                          (f"lightkeeper(a,b): {why}", (True, "lightkeeper(b): still "
                                                                "quarantined by b")),
                          (f"lightkeeper(b): {why}", None),
                          ("operator: bad DIMM", None)):
        subprocess.run(["scontrol", "update", "NodeName=localhost", "State=DRAIN",
                        f"Reason={reason}"], check=True)
        assert node("n1") == (True, reason) and node("n2") == (False, "")
        res = sink.release(release)
        assert res.ok, res.detail
        if after is None:
            assert res.detail == "node localhost unknown to Slurm, nothing to release", \
                res.detail
        else:
            assert res.detail.startswith("scontrol update NodeName=n1 "), res.detail
        assert node("n1") == (after or (True, reason)) and node("n2") == (False, "")


def test_a_release_of_a_node_hostname_several_nodes_carry_does_nothing(slurm, monkeypatch,
                                                                       caplog):
    """n1 and n2 both carry NodeHostname localhost (several slurmd on one host). Job a
    quarantined n2 by its own name, still held; the release of ``localhost`` cannot tell which
    node an older version's update drained, nor n2's own quarantine from such a drain: nothing
    done, n2 still drained, and the release is done (a failure could never be cleared while
    n2's quarantine holds), its detail and one warning naming the nodes for the operator."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sink = SlurmSink()
    q = sink.quarantine({**EVENT, "node": "n2", "job": "a",
                         "finding": {"id": 1, "replica_group": 1}})
    assert q.ok, q.detail
    drained = node("n2")
    assert drained[0]
    caplog.set_level(logging.WARNING, logger="monitor.act.sinks.hooks")
    res = sink.release({**EVENT, "event": "release", "node": "localhost", "job": "a"})
    assert res.ok and res.detail == (
        "node localhost is ambiguous: the NodeHostName of n1,n2; nothing done: an older "
        "version's drain, if any, is left to lift by hand (see docs/quarantine.md)"), res.detail
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "NodeHostName of n1,n2" in warned[0] \
        and "scontrol show node <n>" in warned[0] and "lightkeeper(...) reason of job a" \
        in warned[0], warned
    assert node("n2") == drained and node("n1") == (False, "")


def quarantined_as(node_name: str, led: HostLedger, clock: Clock) -> None:
    """``led`` quarantines host h1, its ranks naming their node ``node_name``, and acts."""
    f = finding("hang", "h1", 1)
    f["evidence"]["culprits"][0]["node"] = node_name
    led.record([f], clock())
    assert [d["decision"] for d in led.decide(clock(), None, 10)] == ["quarantine"]
    led.run_actions(clock())


def last_action(led: HostLedger, clock: Clock) -> tuple[str, str, str]:
    a = next(h for h in led.to_json(clock()) if h["host"] == "h1")["last_action"]
    return a["op"], a["status"], a["detail"]


def test_a_release_through_a_node_hostname_whose_quarantine_failed_updates_nothing(
        slurm, monkeypatch, tmp_path, caplog):
    """Job a's ranks named their node localhost, n1's NodeHostName alone: the quarantine failed
    for good, nothing sent. Given NODE_NAME, job a (another of its monitors) quarantined n1 by
    its own name. The release of localhost finds n1 drained by job a, but through that name
    this version drained nothing: n1's own quarantine stays, and the release is done, its
    detail and a warning naming the node (an older version's drain, if any, is the
    operator's)."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    subprocess.run(["scontrol", "update", "NodeName=n2", "NodeHostname=n2host"], check=True)
    clock = Clock()
    led = HostLedger(Store(str(tmp_path / "m.sqlite")), QuarantineConfig(), [SlurmSink()], "a",
                     clock)
    quarantined_as("localhost", led, clock)
    assert last_action(led, clock) == ("quarantine", "failed", UNKNOWN.format("localhost"))
    assert SlurmSink().quarantine({**EVENT, "node": "n1", "job": "a",
                                   "finding": {"id": 7, "replica_group": 1}}).ok
    drained = node("n1")
    assert drained == (True, "lightkeeper(a): dead_rank finding 7 replica_group 1")
    caplog.set_level(logging.WARNING, logger="monitor.act.sinks.hooks")
    led.release("h1", "the failed host released")
    led.run_actions(clock())
    assert last_action(led, clock) == (
        "release", "done", "node localhost is the NodeHostName of n1 and its quarantine here "
        "was not done (failed); nothing done: an older version's drain, if any, is left to lift "
        "by hand (see docs/quarantine.md)")
    warned = [r.getMessage() for r in caplog.records if r.name == "monitor.act.sinks.hooks"]
    assert len(warned) == 1 and "NodeHostName of n1:" in warned[0], warned
    assert node("n1") == drained and node("n2") == (False, "")


def test_an_older_versions_drain_through_a_node_hostname_is_released_once_its_sink_is_fixed(
        slurm, monkeypatch, tmp_path):
    """An older version quarantined host h1, named localhost, with ``update
    NodeName=localhost`` (n1 drained, done), and its release failed for good (its Slurm user
    not allowed). This version's release, once that is fixed, undoes that quarantine: n1 is
    undrained through its NodeHostName."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    subprocess.run(["scontrol", "update", "NodeName=n2", "NodeHostname=n2host"], check=True)

    class Older:
        name, per_job = "slurm", True

        def quarantine(self, event):
            subprocess.run(["scontrol", "update", f"NodeName={event['node']}", "State=DRAIN",
                            "Reason=lightkeeper(a): hang finding 1 replica_group 1"], check=True)
            return ActionResult(True, "scontrol update exited 0")

        def release(self, event):
            return ActionResult(False, "scontrol update exited 1: Invalid user id", retry=False)

    clock, store = Clock(), Store(str(tmp_path / "m.sqlite"))
    older = HostLedger(store, QuarantineConfig(), [Older()], "a", clock)
    quarantined_as("localhost", older, clock)
    assert node("n1") == (True, "lightkeeper(a): hang finding 1 replica_group 1")
    older.release("h1", "a false alarm")
    older.run_actions(clock())
    assert last_action(older, clock)[:2] == ("release", "failed")
    led = HostLedger(store, QuarantineConfig(), [SlurmSink()], "a", clock)
    led.release("h1", "the Slurm user fixed")
    led.run_actions(clock())
    op, status, detail = last_action(led, clock)
    assert (op, status) == ("release", "done") and detail.startswith(
        "scontrol update NodeName=n1 State=UNDRAIN"), detail
    assert node("n1") == node("n2") == (False, "")


def test_a_release_of_a_node_addr_is_no_alias(slurm, monkeypatch):
    """Slurm's update takes no NodeAddr (Invalid node name), so no older version drained a
    node through one: the release of ``127.0.0.1`` leaves n1, which job a quarantined by its
    own name, drained."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sink = SlurmSink()
    assert sink.quarantine({**EVENT, "node": "n1", "job": "a",
                            "finding": {"id": 1, "replica_group": 1}}).ok
    drained = node("n1")
    res = sink.release({**EVENT, "event": "release", "node": "127.0.0.1", "job": "a"})
    assert res.ok and res.detail == "node 127.0.0.1 unknown to Slurm, nothing to release", \
        res.detail
    assert drained[0] and node("n1") == drained


def test_a_release_by_a_job_the_drain_does_not_list_leaves_it(slurm, monkeypatch):
    """Job b drained n2; a release by job c (a host saved by an older version, released by a
    monitor run under another --job), or b's release repeated after a's, sends no update: b's
    finding stays b's reason and a's drain stays, and the release is done, naming who holds
    the node."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sink = SlurmSink()
    b = {**EVENT, "node": "n2", "job": "b", "finding": {"id": 9, "replica_group": 1}}
    assert sink.quarantine(b).ok
    held = (True, "lightkeeper(b): dead_rank finding 9 replica_group 1")
    assert node("n2") == held
    res = sink.release({**b, "event": "release", "job": "c"})
    assert res.ok and res.detail == "node n2 drained by b, not by job c: left as it is", \
        res.detail
    assert node("n2") == held
    assert sink.quarantine({**b, "job": "a"}).ok
    assert sink.release({**b, "event": "release"}).ok
    assert node("n2") == (True, "lightkeeper(a): still quarantined by a")
    res = sink.release({**b, "event": "release"})  # b's again
    assert res.ok and res.detail == "node n2 drained by a, not by job b: left as it is", \
        res.detail
    assert node("n2") == (True, "lightkeeper(a): still quarantined by a")
    assert sink.release({**b, "event": "release", "job": "a"}).ok
    assert node("n2") == (False, "")
