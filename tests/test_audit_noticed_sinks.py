"""The ``slurm`` quarantine sink against a REAL loopback Slurm controller (tests/test_hosts_sinks.py's
fixture: Debian's slurmctld, slurmd, munged; root only), as sites run it: ranks that report their
host's FQDN while Slurm's NodeName is the short name, and two jobs' monitors on one node; the
``k8s`` sink's two jobs on one node against a fake API server."""

from __future__ import annotations

import subprocess

import pytest

from monitor.act.sinks.hooks import SlurmSink
from tests import test_hosts_sinks

slurm, slurm_cluster = test_hosts_sinks.slurm, test_hosts_sinks.slurm_cluster
kube = test_hosts_sinks.kube
EVENT = test_hosts_sinks.EVENT


def node(name: str) -> tuple[str, str]:
    out = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True,
                         check=True).stdout
    state = out.split("State=")[1].split()[0].replace("+NOT_RESPONDING", "")
    reason = out.split("Reason=")[1].splitlines()[0].rsplit(" [", 1)[0] if "Reason=" in out else ""
    return state, reason


@pytest.mark.e2e
def test_fqdn_hosts_and_two_jobs_on_one_node(slurm, monkeypatch):
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sink = SlurmSink()
    # a rank on n1 reports its FQDN (no NODE_NAME under Slurm: the hostname): every drain of
    # it used to fail, "Invalid node name specified", and was never retried
    alpha = {**EVENT, "job": "alpha", "host": "n1.cluster.local", "node": "n1.cluster.local"}
    res = sink.quarantine(alpha)
    assert res.ok, res.detail
    assert node("n1") == ("ALLOCATED+DRAIN",
                          "lightkeeper(alpha): dead_rank finding 7 replica_group 2")
    # job beta's monitor quarantines the same node, then releases it: alpha's drain stays
    beta = {**alpha, "job": "beta", "finding": {"id": 3, "replica_group": 0}, "kind": "hang"}
    assert sink.quarantine(beta).ok
    assert node("n1") == ("ALLOCATED+DRAIN", "lightkeeper(alpha,beta): hang finding 3 replica_group 0")
    assert sink.release(beta).ok
    # beta's finding is no longer alpha's reason
    assert node("n1") == ("ALLOCATED+DRAIN", "lightkeeper(alpha): still quarantined by alpha")
    assert sink.release(alpha).ok  # the last job's release undrains it
    assert node("n1") == ("ALLOCATED", "")
    # a name Slurm knows neither whole nor short stays refused, nothing drained
    bad = sink.quarantine({**alpha, "node": "n9.cluster.local"})
    assert not bad.ok and not bad.retry and "unknown to Slurm" in bad.detail
    assert [node(n)[0] for n in ("n1", "n2")] == ["ALLOCATED", "ALLOCATED"]


def test_k8s_two_jobs_on_one_node_release_only_their_own(kube):
    """The same on Kubernetes, against the FAKE API server of tests/test_hosts_sinks.py (none
    can run here; it keeps the node's taints and annotations): each job's quarantine is a taint
    of its own, the default selector deletes only that job's pods, and one job's release leaves
    the node cordoned, tainted and quarantined while the other's quarantine stands."""
    api, rx, sink = kube
    api.pods = {f"{j}-0": ("node-1", {**api.JOB_POD, "lightkeeper/job": j})
                for j in ("alpha", "beta")}
    alpha, beta = {**EVENT, "job": "alpha"}, {**EVENT, "job": "beta", "kind": "hang"}
    assert sink.quarantine(alpha).ok and sink.quarantine(beta).ok
    lists = [r for r in rx.requests if r.method == "GET" and r.path.endswith("/pods")]
    assert [r.query["labelSelector"] for r in lists] == [  # the claim's check, the deletion
        [f"app.kubernetes.io/component=training,lightkeeper/job={j}"]
        for j in ("alpha", "alpha", "beta", "beta")]

    def quarantine_taints():
        return [(t["key"], t["value"]) for t in api.node["spec"]["taints"]
                if t["key"].startswith("lightkeeper.io/")]
    assert quarantine_taints() == [("lightkeeper.io/quarantined-alpha", "dead_rank"),
                                   ("lightkeeper.io/quarantined-beta", "hang")]
    rx.requests.clear()
    res = sink.release({**beta, "event": "release"})
    assert res.ok and "still quarantined by lightkeeper.io/quarantined-alpha" in res.detail
    assert quarantine_taints() == [("lightkeeper.io/quarantined-alpha", "dead_rank")]
    assert api.node["spec"]["unschedulable"] is True
    # the condition stays True, now naming alpha's quarantine
    assert [r.path for r in rx.requests if r.method == "PATCH"] == \
        ["/api/v1/nodes/node-1/status", "/api/v1/nodes/node-1"]
    assert sink.release({**alpha, "event": "release"}).ok
    assert quarantine_taints() == [] and api.node["spec"]["unschedulable"] is False
