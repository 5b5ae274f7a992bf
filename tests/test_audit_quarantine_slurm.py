"""Host quarantine with REAL Slurm, set up as docs/quarantine.md says: ``lightkeeper monitor``'s
own flags (``--action slurm``), a real loopback Slurm controller with nodes ``n1`` and ``n2``
(tests/test_hosts_sinks.py's fixture: Debian's slurmctld, slurmd, munged; root only), a real
torchft Lighthouse and simulated ranks (tests/support/monitor_sim.py) whose ``node`` names the
Slurm nodes. A dead rank drains its node with the documented reason, a release resumes it, a
restart with the same ``--state`` keeps the quarantine and drains nothing twice, ``--dry-run``
drains nothing, and a rank claiming the node ``ALL`` drains no node."""

from __future__ import annotations

import argparse
import subprocess

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.cli import add_arguments, config_from_args
from monitor.service import Monitor
from tests import test_hosts_sinks
from tests.support.monitor_sim import SimJob

pytestmark = pytest.mark.e2e
slurm, slurm_cluster = test_hosts_sinks.slurm, test_hosts_sinks.slurm_cluster
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def job(slurm, monkeypatch):
    """Four groups of two ranks, group g on host hg; h0 and h1 on Slurm nodes n1 and n2, all
    in the Slurm job that runs there."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sim = SimJob(4, ranks_per_group=2)
    try:
        for r in sim.sim.ranks:
            g = r.state["replica_group"]
            # each in the Slurm job running on n1 and n2 (srun's SLURM_JOB_ID)
            r.update(host=f"h{g}", node=("n1", "n2", "x2", "x3")[g], device={"type": "cpu"},
                     slurm_job_id=test_hosts_sinks.SLURM_JOBS[0])
        yield sim
    finally:
        sim.stop()


def monitor(job: SimJob, state: str, *flags: str) -> Monitor:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--targets", ",".join(job.sim.urls), "--lighthouse", job.url,
                         "--port", "0", "--interval", "0.2", "--state", state, "--job", "sim",
                         "--token", TOKEN, "--min-replicas", "1", "--cooldown", "0",
                         "--dead-sweeps", "2", "--action", "slurm", "--max-quarantined", "1",
                         *flags])
    return Monitor(config_from_args(args)).start()


def node(name: str) -> tuple[bool, str]:
    """(drained, reason) as ``scontrol show node`` says (a loopback slurmd may also show
    NOT_RESPONDING: not what is checked here)."""
    out = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True,
                         check=True).stdout
    drained = "DRAIN" in out.split("State=")[1].split()[0]
    return drained, out.split("Reason=")[1].split(" [")[0].strip() if "Reason=" in out else ""


def hosts(mon: Monitor) -> dict:
    return requests.get(mon.url + "/v1/hosts", timeout=5).json()


def last_action(mon: Monitor, host: str) -> dict:
    h = next((h for h in hosts(mon)["hosts"] if h["host"] == host), {})
    return h.get("last_action") or {}


def kill_rank_of_group_1(job: SimJob) -> None:
    job.sim.group(1)[-1].set_mode("down")  # dead_rank in live group 1: culprit on h1 (n2)


def test_a_dead_rank_drains_its_node_a_restart_keeps_it_a_release_resumes_it(job, tmp_path):
    state = str(tmp_path / "state.sqlite")
    mon = monitor(job, state)
    try:
        wait_until(lambda: mon.sweeps >= 2, 10, what="two sweeps")
        kill_rank_of_group_1(job)
        wait_until(lambda: last_action(mon, "h1").get("status") == "done", 30,
                   what="h1's drain carried out")
        fid = next(f["id"] for f in requests.get(mon.url + "/v1/findings", timeout=5).json()
                   if f["kind"] == "dead_rank")
        assert node("n2") == (True, f"lightkeeper(sim): dead_rank finding {fid} replica_group 1")
        assert node("n1") == (False, "")
        body = hosts(mon)
        assert body["quarantined"] == ["h1"] and body["actions"] == ["slurm"]
        assert [(d["host"], d["decision"], d["reason"]) for d in body["decisions"]] == [
            ("h1", "quarantine", "dead_rank")]
        text = requests.get(mon.url + "/metrics", timeout=5).text
        assert ('lightkeeper_monitor_host_quarantine_state{host="h1",job="sim",node="n2",'
                'state="quarantined"} 1.0') in text
        assert "lightkeeper_monitor_host_action_failed{" not in text
    finally:
        mon.stop()
    again = monitor(job, state)  # the same --state: the quarantine survives, nothing redone
    try:
        sweeps = again.sweeps
        wait_until(lambda: again.sweeps >= sweeps + 10, 20, what="ten sweeps after a restart")
        body = hosts(again)
        assert body["quarantined"] == ["h1"] and len(body["decisions"]) == 1
        assert last_action(again, "h1")["id"] == 1 and node("n2")[0]
        r = requests.post(again.url + "/v1/hosts/h1/release", json={"reason": "DIMM replaced"},
                          timeout=5)
        assert r.status_code == 401  # no token, nothing released
        r = requests.post(again.url + "/v1/hosts/h1/release", json={"reason": "DIMM replaced"},
                          headers=AUTH, timeout=5)
        assert r.status_code == 200, r.text
        wait_until(lambda: last_action(again, "h1").get("op") == "release"
                   and last_action(again, "h1").get("status") == "done", 20,
                   what="h1's resume carried out")
        assert node("n2") == (False, "")
        assert requests.post(again.url + "/v1/hosts/h1/release", headers=AUTH,
                             timeout=5).status_code == 409
        assert [d["decision"] for d in hosts(again)["decisions"]] == ["release", "quarantine"]
    finally:
        again.stop()


def test_dry_run_drains_no_node(job, tmp_path):
    """``--dry-run`` ("detect and report, never evict") with ``--action slurm``: a quarantine
    is decided and logged as dry_run, and no node is drained."""
    mon = monitor(job, str(tmp_path / "state.sqlite"), "--dry-run")
    try:
        wait_until(lambda: mon.sweeps >= 2, 10, what="two sweeps")
        kill_rank_of_group_1(job)
        wait_until(lambda: hosts(mon)["decisions"], 30, what="a host decision")
        body = hosts(mon)
        assert [(d["host"], d["decision"], d["reason"]) for d in body["decisions"]] == [
            ("h1", "quarantine", "dry_run")]
        assert body["dry_run"] is True and body["quarantined"] == []
        assert last_action(mon, "h1") == {}  # nothing queued, so nothing will ever drain
        assert node("n2") == (False, "")
    finally:
        mon.stop()


def test_a_rank_claiming_node_all_drains_no_node(job, tmp_path):
    """A quarantine of a host whose ranks say ``NODE_NAME=ALL``: scontrol's ``NodeName=ALL``
    would drain every node past ``--max-quarantined 1``; the action fails at once, shown on
    /v1/hosts and the metric, and both Slurm nodes stay up."""
    for r in job.sim.group(1):
        r.update(node="ALL")
    mon = monitor(job, str(tmp_path / "state.sqlite"))
    try:
        wait_until(lambda: mon.sweeps >= 2, 10, what="two sweeps")
        kill_rank_of_group_1(job)
        wait_until(lambda: last_action(mon, "h1").get("status") == "failed", 30,
                   what="h1's drain refused")
        a = last_action(mon, "h1")
        assert a["attempts"] == 1 and "not one node name" in a["detail"]
        assert node("n1") == node("n2") == (False, "")
        failed = 'lightkeeper_monitor_host_action_failed{host="h1",job="sim",sink="slurm"} 1.0'
        wait_until(lambda: failed in requests.get(mon.url + "/metrics", timeout=5).text, 10,
                   what="the failed action on /metrics (set by the next sweep)")
    finally:
        mon.stop()



def test_a_release_after_a_restart_under_another_job_undrains_the_node(job, tmp_path):
    """The monitor restarted on the same ``--state`` with another ``--job`` (the flag forgotten,
    the job renamed): the release names the job whose monitor drained the node, so the node is
    undrained, not re-drained for that job while the release says done."""
    state = str(tmp_path / "state.sqlite")
    mon = monitor(job, state)
    try:
        wait_until(lambda: mon.sweeps >= 2, 10, what="two sweeps")
        kill_rank_of_group_1(job)
        wait_until(lambda: last_action(mon, "h1").get("status") == "done", 30,
                   what="h1's drain carried out")
        assert node("n2")[0] and node("n2")[1].startswith("lightkeeper(sim): dead_rank")
    finally:
        mon.stop()
    again = monitor(job, state, "--job", "renamed")
    try:
        h1 = next(h for h in hosts(again)["hosts"] if h["host"] == "h1")
        assert (h1["state"], h1["job"]) == ("quarantined", "sim")
        r = requests.post(again.url + "/v1/hosts/h1/release", json={"reason": "fixed"},
                          headers=AUTH, timeout=5)
        assert r.status_code == 200, r.text
        wait_until(lambda: last_action(again, "h1").get("op") == "release"
                   and last_action(again, "h1").get("status") == "done", 20,
                   what="h1's release carried out")
        assert node("n2") == (False, "")
    finally:
        again.stop()


def test_a_node_slurm_does_not_know_is_released_and_alerts_no_more(job, tmp_path):
    """Ranks claim node ``n9``, which Slurm does not know: the drain fails for good and the
    failed action is on /metrics. The release has nothing to undo: done, saying so, and the
    alert clears."""
    for r in job.sim.group(1):
        r.update(node="n9")
    mon = monitor(job, str(tmp_path / "state.sqlite"))
    try:
        wait_until(lambda: mon.sweeps >= 2, 10, what="two sweeps")
        kill_rank_of_group_1(job)
        wait_until(lambda: last_action(mon, "h1").get("status") == "failed", 30,
                   what="h1's drain refused")
        assert "unknown to Slurm" in last_action(mon, "h1")["detail"]
        failed = 'lightkeeper_monitor_host_action_failed{host="h1",job="sim",sink="slurm"} 1.0'
        wait_until(lambda: failed in requests.get(mon.url + "/metrics", timeout=5).text, 10,
                   what="the failed action on /metrics")
        r = requests.post(mon.url + "/v1/hosts/h1/release", json={"reason": "not ours"},
                          headers=AUTH, timeout=5)
        assert r.status_code == 200, r.text
        wait_until(lambda: last_action(mon, "h1").get("op") == "release"
                   and last_action(mon, "h1").get("status") in ("done", "failed"), 20,
                   what="h1's release judged")
        a = last_action(mon, "h1")
        assert (a["status"], a["detail"]) == ("done", "node n9 unknown to Slurm, nothing to "
                                              "release"), a
        sweeps = mon.sweeps
        wait_until(lambda: mon.sweeps >= sweeps + 2, 10, what="two sweeps after the release")
        assert "lightkeeper_monitor_host_action_failed{" not in requests.get(
            mon.url + "/metrics", timeout=5).text
        assert node("n1") == node("n2") == (False, "")
    finally:
        mon.stop()
