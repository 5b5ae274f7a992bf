"""The ``slurm`` quarantine sink as a Slurm site meets it, against a REAL loopback Slurm
controller (tests/test_hosts_sinks.py's fixture: Debian's slurmctld, slurmd, munged; root only):
a release after the operator resumed the node, a node the operator set DOWN, and a monitor whose
Slurm user may not update nodes (the real ``scontrol`` run as ``nobody`` through ``setpriv``)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from monitor.act.sinks.hooks import SlurmSink
from tests import test_hosts_sinks
from tests.conftest import require_binary

slurm, slurm_cluster = test_hosts_sinks.slurm, test_hosts_sinks.slurm_cluster
EVENT = test_hosts_sinks.EVENT
pytestmark = pytest.mark.e2e


@pytest.fixture
def env(slurm, monkeypatch):
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    return slurm


def node(name: str) -> tuple[str, str]:
    """(state, reason) as ``scontrol show node`` says, the state without NOT_RESPONDING (a
    loopback slurmd asked to register again shows it a moment)."""
    out = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True,
                         check=True).stdout
    state = out.split("State=")[1].split()[0].replace("+NOT_RESPONDING", "")
    reason = out.split("Reason=")[1].splitlines()[0].rsplit(" [", 1)[0] if "Reason=" in out else ""
    return state, reason


def scontrol(*args: str) -> None:
    subprocess.run(["scontrol", *args], check=True, capture_output=True)


def test_release_after_the_operator_resumed_the_node_is_done_not_retried(env):
    """An operator resumes the drained node (fixed it) before the monitor's release or its TTL
    expiry: the release has nothing left to do. It was a failed, retried action
    (``Invalid node state specified``), shown failed on /v1/hosts and the metric after 6."""
    sink = SlurmSink()
    assert sink.quarantine({**EVENT, "node": "n1"}).ok
    assert node("n1")[0] == "ALLOCATED+DRAIN"  # the ranks' job runs there
    scontrol("update", "NodeName=n1", "State=RESUME")
    res = sink.release({**EVENT, "node": "n1"})
    assert res.ok, res.detail
    assert node("n1") == ("ALLOCATED", "")


def test_release_leaves_a_node_the_operator_set_down_down(env):
    """A node an operator set DOWN (hardware work) when its host is quarantined is theirs: the
    quarantine neither drains it nor replaces their reason, and the release (or TTL expiry)
    leaves it DOWN. It was resumed back into service, then drained over with the note lost.
    ReturnToService=1 (Slurm's usual): the fixture's 2 returns any DOWN node to service when it
    registers, whoever set it DOWN."""
    conf = Path(env["SLURM_CONF"])
    conf.write_text(conf.read_text().replace("ReturnToService=2", "ReturnToService=1"))
    scontrol("reconfigure")
    scontrol("update", "NodeName=n2", "State=DOWN", "Reason=RMA: reseat GPU")
    sink = SlurmSink()
    for op in (sink.quarantine, sink.release):  # the operator's note not replaced by ours
        res = op({**EVENT, "node": "n2"})
        assert res.ok and res.detail == "node n2 left down by someone else: RMA: reseat GPU", res
        assert node("n2") == ("DOWN", "RMA: reseat GPU")
    # n1 untouched (its state: the end of the job n2's DOWN killed, IDLE+COMPLETING a while)
    state, reason = node("n1")
    assert "DRAIN" not in state and reason == "", (state, reason)


def test_a_slurm_user_not_allowed_to_update_nodes_fails_at_once(env, tmp_path, monkeypatch):
    """The monitor runs as a user Slurm does not let update nodes: the drain fails at the first
    attempt, not retried (docs/quarantine.md: retrying cannot help), and nothing is drained."""
    setpriv = require_binary("setpriv")
    wrapper = tmp_path / "bin" / "scontrol"  # the real scontrol, as nobody
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {setpriv} --reuid=65534 --regid=65534 --clear-groups '
                       f'{shutil.which("scontrol")} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC | stat.S_IXOTH | stat.S_IROTH)
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{path}")
    res = SlurmSink().quarantine({**EVENT, "node": "n1"})
    assert not res.ok and not res.retry, res
    assert "Invalid user id" in res.detail or "permission denied" in res.detail, res.detail
    monkeypatch.setenv("PATH", path)
    assert node("n1") == ("ALLOCATED", "")
