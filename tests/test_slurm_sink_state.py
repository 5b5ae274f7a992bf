"""The slurm sink against a stand-in ``scontrol`` on PATH that keeps one node's state (``n1``)
as Slurm does: ``show node`` answers it, ``update`` changes it, and slurmctld can be made slow
(``show node`` times out or says ``Socket timed out``). What is checked is what Slurm would
hold afterwards and which commands reached it (the real controller: test_hosts_sinks.py)."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from monitor.act.sinks.hooks import SlurmSink

EVENT = {"event": "quarantine", "host": "n1", "node": "n1", "kind": "hang", "job": "jobA",
         "finding": {"id": 3, "kind": "hang", "replica_group": 1}, "action_id": 1,
         "attempt": 1, "slurm_jobs": ["1"]}

FAKE = r"""#!/bin/sh
D=$(dirname "$0")
echo "$*" >> "$D/log"
if [ "$1" = show ]; then
  case "$(cat "$D/ctld")" in
    slow) exec sleep 5;;
    flaky) echo "slurm_load_node error: Socket timed out on send/recv operation" >&2; exit 1;;
    private) echo "slurm_load_node error: Access/permission denied" >&2; exit 1;;
  esac
  if [ "$3" != n1 ]; then echo "Node $3 not found"; exit 1; fi
  printf 'NodeName=n1 Arch=x86_64 CoresPerSocket=1 \n   State=%s ThreadsPerCore=1\n' \
    "$(cat "$D/state")"
  if [ -s "$D/reason" ]; then printf '   Reason=%s [root@2026-11-28T10:00:00]\n' \
    "$(cat "$D/reason")"; fi
  exit 0
fi
if [ "$2" != NodeName=n1 ]; then echo "Invalid node name specified" >&2; exit 1; fi
case "$3" in
  State=DRAIN) echo IDLE+DRAIN > "$D/state"; printf '%s' "${4#Reason=}" > "$D/reason";;
  State=UNDRAIN) echo IDLE > "$D/state"; : > "$D/reason";;
esac
"""


class Slurm:
    def __init__(self, d):
        self.d = d

    def set(self, state: str, reason: str = "", ctld: str = "ok") -> None:
        (self.d / "state").write_text(state)
        (self.d / "reason").write_text(reason)
        (self.d / "ctld").write_text(ctld)

    def ctld(self, how: str) -> None:
        (self.d / "ctld").write_text(how)

    def node(self) -> tuple[str, str]:
        return (self.d / "state").read_text().strip(), (self.d / "reason").read_text()

    def updates(self) -> list[str]:
        log = self.d / "log"
        return [c for c in log.read_text().splitlines() if c.startswith("update")] \
            if log.exists() else []


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "squeue").write_text("#!/bin/sh\necho 1\n")  # n1 runs the ranks' job 1
    (tmp_path / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    s = Slurm(tmp_path)
    s.set("IDLE")
    return s


@pytest.mark.parametrize("ctld,node", [("flaky", "n1"), ("flaky", "n1.cluster.local"),
                                       ("slow", "n1.cluster.local")])
@pytest.mark.parametrize("held", [
    ("IDLE+DRAIN", "lightkeeper(jobA,jobB): hang finding 3 replica_group 1"),  # B's stays
    ("IDLE+DRAIN", "RMA DIMM"),  # an operator's
    ("IDLE", ""),
])
def test_a_node_state_not_read_sends_no_update(slurm, ctld, node, held):
    """slurmctld slow: ``show node`` times out or fails with ``Socket timed out``. No update
    follows (it would lift job B's or an operator's drain, overwrite the operator's reason, or
    go to the FQDN Slurm refuses): the attempt fails, retried; once Slurm answers again the
    retry does what it should."""
    slurm.set(*held, ctld=ctld)
    sink = SlurmSink(timeout_s=0.2)
    for op in (sink.quarantine, sink.release):
        res = op({**EVENT, "node": node})
        assert not res.ok and res.retry and res.detail.startswith("cannot read node state: "), \
            res.detail
        assert slurm.updates() == [] and slurm.node() == held
    slurm.ctld("ok")
    res = sink.release({**EVENT, "node": node})
    assert res.ok, res.detail
    if held[1] == "RMA DIMM":
        assert slurm.updates() == [] and slurm.node() == held
    else:
        assert slurm.updates() == [
            "update NodeName=n1 State=DRAIN Reason=lightkeeper(jobB): still quarantined by jobB"
            if held[1] else "update NodeName=n1 State=UNDRAIN"]


def test_a_node_state_slurm_will_never_show_fails_for_good(slurm):
    """``PrivateData=nodes``: this user may not read node state. No retry mends that: the
    attempt fails for good (as the same refusal of ``update`` does), never retried for ever."""
    slurm.set("IDLE", ctld="private")
    for op in (SlurmSink(timeout_s=5).quarantine, SlurmSink(timeout_s=5).release):
        res = op(EVENT)
        assert not res.ok and not res.retry and "Access/permission denied" in res.detail, \
            res.detail
    assert slurm.updates() == []


def test_a_node_slurm_does_not_know_is_still_looked_up_by_its_first_label(slurm):
    """``Node n1.cluster.local not found`` (exit 1) is no failure: the first label is next."""
    res = SlurmSink(timeout_s=5).quarantine({**EVENT, "node": "n1.cluster.local"})
    assert res.ok, res.detail
    assert slurm.node() == ("IDLE+DRAIN", "lightkeeper(jobA): hang finding 3 replica_group 1")
    res = SlurmSink(timeout_s=5).quarantine({**EVENT, "node": "n9.cluster.local"})
    assert not res.ok and not res.retry and "unknown to Slurm" in res.detail, res.detail


def _hashed(job: str) -> str:
    return hashlib.sha256(job.encode()).hexdigest()[:8]


def test_two_jobs_whose_names_fold_alike_keep_two_entries(slurm):
    """``team/a`` and ``team_a`` quarantine the same node: two entries, not one; the first
    release leaves the node drained for the other job, the second undrains it."""
    sink = SlurmSink(timeout_s=5)
    for job in ("team/a", "team_a"):
        assert sink.quarantine({**EVENT, "job": job}).ok
    slash = f"team_a-{_hashed('team/a')}"
    assert slurm.node() == ("IDLE+DRAIN",
                            f"lightkeeper(team_a,{slash}): hang finding 3 replica_group 1")
    assert sink.release({**EVENT, "job": "team/a"}).ok
    assert slurm.node() == ("IDLE+DRAIN", "lightkeeper(team_a): still quarantined by team_a")
    assert sink.release({**EVENT, "job": "team_a"}).ok
    assert slurm.node() == ("IDLE", "")
    # in the other order too
    for job in ("team_a", "team/a"):
        assert sink.quarantine({**EVENT, "job": job}).ok
    assert sink.release({**EVENT, "job": "team_a"}).ok
    assert slurm.node() == ("IDLE+DRAIN", f"lightkeeper({slash}): still quarantined by {slash}")
    assert sink.release({**EVENT, "job": "team/a"}).ok
    assert slurm.node() == ("IDLE", "")


def test_a_drain_by_the_older_fold_is_still_released(slurm):
    """A node the previous version drained for ``team/a`` lists ``team_a`` (the fold alone):
    team/a's release takes it off while its own entry is not listed; where it is, the fold is
    job team_a's and stays."""
    sink = SlurmSink(timeout_s=5)
    slurm.set("IDLE+DRAIN", "lightkeeper(team_a): hang finding 3 replica_group 1")
    assert sink.release({**EVENT, "job": "team/a"}).ok
    assert slurm.node() == ("IDLE", "")
    slurm.set("IDLE+DRAIN", "lightkeeper(jobB,team_a): hang finding 3 replica_group 1")
    assert sink.release({**EVENT, "job": "team/a"}).ok
    assert slurm.node() == ("IDLE+DRAIN", "lightkeeper(jobB): still quarantined by jobB")
    slash = f"team_a-{_hashed('team/a')}"
    slurm.set("IDLE+DRAIN", f"lightkeeper(team_a,{slash}): hang finding 3 replica_group 1")
    assert sink.release({**EVENT, "job": "team/a"}).ok
    assert slurm.node() == ("IDLE+DRAIN", "lightkeeper(team_a): still quarantined by team_a")
