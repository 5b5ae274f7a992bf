"""The ``slurm`` quarantine sink against a REAL loopback Slurm controller (tests/test_hosts_sinks.py's
fixture: Debian's slurmctld, slurmd, munged; root only), as sites run it: ranks that report their
host's FQDN while Slurm's NodeName is the short name, and two jobs' monitors on one node."""

from __future__ import annotations

import subprocess

import pytest

from monitor.act.sinks.hooks import SlurmSink
from tests import test_hosts_sinks

slurm = test_hosts_sinks.slurm
EVENT = test_hosts_sinks.EVENT
pytestmark = pytest.mark.e2e


def node(name: str) -> tuple[str, str]:
    out = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True,
                         check=True).stdout
    state = out.split("State=")[1].split()[0].replace("+NOT_RESPONDING", "")
    reason = out.split("Reason=")[1].splitlines()[0].rsplit(" [", 1)[0] if "Reason=" in out else ""
    return state, reason


def test_fqdn_hosts_and_two_jobs_on_one_node(slurm, monkeypatch):
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sink = SlurmSink()
    # a rank on n1 reports its FQDN (no NODE_NAME under Slurm: the hostname): every drain of
    # it used to fail, "Invalid node name specified", and was never retried
    alpha = {**EVENT, "job": "alpha", "host": "n1.cluster.local", "node": "n1.cluster.local"}
    res = sink.quarantine(alpha)
    assert res.ok, res.detail
    assert node("n1") == ("IDLE+DRAIN",
                          "lightkeeper(alpha): dead_rank finding 7 replica_group 2")
    # job beta's monitor quarantines the same node, then releases it: alpha's drain stays
    beta = {**alpha, "job": "beta", "finding": {"id": 3, "replica_group": 0}, "kind": "hang"}
    assert sink.quarantine(beta).ok
    assert node("n1") == ("IDLE+DRAIN", "lightkeeper(alpha,beta): hang finding 3 replica_group 0")
    assert sink.release(beta).ok
    assert node("n1") == ("IDLE+DRAIN", "lightkeeper(alpha): hang finding 3 replica_group 0")
    assert sink.release(alpha).ok  # the last job's release undrains it
    assert node("n1") == ("IDLE", "")
    # a name Slurm knows neither whole nor short stays refused, nothing drained
    bad = sink.quarantine({**alpha, "node": "n9.cluster.local"})
    assert not bad.ok and not bad.retry and "Invalid node name" in bad.detail
    assert [node(n)[0] for n in ("n1", "n2")] == ["IDLE", "IDLE"]
