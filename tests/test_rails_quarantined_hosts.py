"""The eviction rail counts the groups on a quarantined host as gone (monitor/act/enforcer.py,
Enforcer.situation; docs/monitor.md, Eviction and safety rails): a quarantine drains its host,
so an eviction in the same sweep, or while the drained ranks still answer, must not take the
quorum below --min-replicas.

A monitor over a real torchft Lighthouse that simulated groups join (``SimJob``,
tests/support/monitor_sim.py), one host per group; the sweep's findings are handed to the
enforcer by hand, in the order the sweep does (record, the host ledger, then decisions).
"""

from __future__ import annotations

import uuid

import pytest

from monitor.api.app import create_app
from monitor.config import BundleConfig, MonitorConfig, QuarantineConfig, RailsConfig
from monitor.detect import Finding
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"


@pytest.fixture
def job():
    j = SimJob(4)
    for g in range(4):
        for r in j.sim.group(g):
            r.update(host=f"host-g{g}", node=f"host-g{g}")
    yield j
    j.stop()


def monitor(tmp_path, job: SimJob, name: str, **quarantine) -> Monitor:
    # --evict-on hang: stragglers are reported (and count against their host), not evicted
    return Monitor(MonitorConfig(
        port=0, state_path=str(tmp_path / f"{name}.sqlite"), targets=job.sim.urls, job="sim",
        lighthouse=job.url, token=TOKEN, bundles=BundleConfig(enabled=False),
        rails=RailsConfig(min_replicas=3, cooldown_s=0, evict_kinds=("hang",)),
        quarantine=QuarantineConfig(after={"straggler": 2}, **quarantine)))


def finding(kind: str, g: int, job: SimJob, now: float) -> Finding:
    culprits = [{"rank": g, "host": f"host-g{g}", "node": f"host-g{g}",
                 "device": {"type": "cpu"}}]
    return Finding(kind, g, job.replica_ids[g], [g], {"culprits": culprits}, now, now)


def hand_in(mon: Monitor, view, findings: list[Finding]) -> None:
    """The sweep's step 4 (monitor.service) with these findings confirmed."""
    now = mon.clock()
    for f in findings:
        mon.detectors.report(f)
    new = mon.enforcer.record(findings, now)
    mon.enforcer.judge_hosts(view, new, now, mon.lighthouse_status)
    mon.enforcer.decide(view, view.evidence(), now)


def test_an_eviction_in_the_sweep_of_a_quarantine_counts_its_groups_gone(tmp_path, job):
    """4 groups, --min-replicas 3. host-g0's second straggler quarantines it (3 left: the host
    rail lets it); in the same sweep a hang in group 1 would leave 2, so it is held, and so is a
    POST /v1/evict of group 1 while group 0's drained ranks still answer. Before, both counted
    group 0 and evicted ("3 remain")."""
    mon = monitor(tmp_path, job, "real")
    try:
        view = mon.sweep_once()  # every group verified in the Lighthouse's quorum
        assert sorted(gv.replica_group for gv in view.evidence().in_quorum()) == [0, 1, 2, 3]
        first = finding("straggler", 0, job, mon.clock())
        hand_in(mon, view, [first])
        mon.detectors.resolve(first.key, "cleared", mon.clock())  # the episode ended
        assert mon.hosts.quarantined() == []  # one straggler of the two it takes

        view = mon.sweep_once()
        hand_in(mon, view, [finding("straggler", 0, job, mon.clock()),
                            finding("hang", 1, job, mon.clock())])
        assert mon.hosts.quarantined() == ["host-g0"]
        client = create_app(mon).test_client()
        decided = client.get("/v1/evictions").get_json()
        assert [(d["decision"], d["replica_group"], d["reason"]) for d in decided] == [
            ("hold", 1, "min_replicas")], decided
        assert "would leave 2 replica group(s)" in decided[0]["detail"], decided

        view = mon.sweep_once()  # group 0's ranks still answer, in the quorum
        assert 0 in {gv.replica_group for gv in view.evidence().in_quorum()}
        r = client.post("/v1/evict", json={"replica_group": 1, "reason": "test"},
                        headers={"Authorization": f"Bearer {TOKEN}"})
        body = r.get_json()
        assert r.status_code == 409 and body["reason"] == "min_replicas", body
        assert client.get("/v1/evictions?decision=evict").get_json() == []
        assert job.kills == []
    finally:
        mon.stop()


def test_a_dry_run_quarantine_holds_no_real_eviction(tmp_path, job):
    """--quarantine-dry-run drains nothing: host-g0's groups stay in the quorum, so the hang in
    group 1 is evicted (3 remain) although host-g0 would have been quarantined."""
    mon = monitor(tmp_path, job, "dry", dry_run=True)
    try:
        view = mon.sweep_once()
        first = finding("straggler", 0, job, mon.clock())
        hand_in(mon, view, [first])
        mon.detectors.resolve(first.key, "cleared", mon.clock())
        view = mon.sweep_once()
        hand_in(mon, view, [finding("straggler", 0, job, mon.clock()),
                            finding("hang", 1, job, mon.clock())])
        (would,) = [h for h in mon.enforcer.hosts_json()["hosts"] if h["host"] == "host-g0"]
        assert would.get("would_quarantine") and mon.hosts.quarantined() == []
        assert job.kills == [job.replica_ids[1]]
    finally:
        mon.stop()


def test_a_host_fault_is_evicted_once_while_its_hosts_quarantine_is_held(tmp_path, job):
    """--max-quarantined 1, host-g0 quarantined: a network fault of host-g2 cannot quarantine
    it (cap). Group 2 is evicted once; restarted on host-g2 (where its restart puts it) and
    found there again, it is held (``quarantine_held``, once), its finding open; released,
    host-g0 frees the cap, host-g2 is quarantined and the group evicted. Before, every
    incarnation was evicted again on the same host until its supervisor gave up."""
    mon = Monitor(MonitorConfig(
        port=0, state_path=str(tmp_path / "m.sqlite"), targets=job.sim.urls, job="sim",
        lighthouse=job.url, token=TOKEN, bundles=BundleConfig(enabled=False),
        rails=RailsConfig(min_replicas=1, cooldown_s=0, evict_kinds=("network",)),
        quarantine=QuarantineConfig(max_quarantined=1)))
    client = create_app(mon).test_client()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        view = mon.sweep_once()
        hand_in(mon, view, [finding("hang", 0, job, mon.clock())])  # counted, not evicted
        assert mon.hosts.quarantined() == ["host-g0"]
        first = job.replica_ids[2]
        hand_in(mon, view, [finding("network", 2, job, mon.clock())])
        assert job.kills == [first] and mon.hosts.quarantined() == ["host-g0"]
        (g2,) = [h for h in mon.enforcer.hosts_json()["hosts"] if h["host"] == "host-g2"]
        assert (g2["state"], g2["hold"]["reason"]) == ("suspect", "cap"), g2

        job.replica_ids[2] = again = f"replica_group_2:{uuid.uuid4()}"
        for r in job.sim.group(2):  # its supervisor restarts it on the same host
            r.update(replica_id=again)
            r.set_mode("ok")
        job.alive.add(2)
        job.requorum()
        view = mon.sweep_once()
        assert view.evidence().groups[2].replica_id == again
        back = finding("network", 2, job, mon.clock())
        hand_in(mon, view, [back])
        hand_in(mon, view, [])  # still held: said once
        assert job.kills == [first]
        held = client.get("/v1/evictions?decision=hold").get_json()
        assert [(d["replica_group"], d["replica_id"], d["reason"]) for d in held
                if d["reason"] != "already_evicted"] == [(2, again, "quarantine_held")], held
        detail = next(d["detail"] for d in held if d["reason"] == "quarantine_held")
        assert f"evicted off host-g2 already ({first})" in detail and "cap" in detail, detail
        assert back.key in {f.key for f in mon.detectors.open_findings()}

        r = client.post("/v1/hosts/host-g0/release", json={"reason": "fixed"}, headers=auth)
        assert r.status_code == 200, r.get_json()
        hand_in(mon, view, [])
        assert mon.hosts.quarantined() == ["host-g2"]
        assert job.kills == [first, again]
    finally:
        mon.stop()


def straggler_evicted(tmp_path, job: SimJob, **after: int):
    """A monitor (--evict-on straggler, --quarantine-after ``after``) that evicted group 1 for
    a straggler, and its view: host-g1 not quarantined."""
    mon = Monitor(MonitorConfig(
        port=0, state_path=str(tmp_path / "m.sqlite"), targets=job.sim.urls, job="sim",
        lighthouse=job.url, token=TOKEN, bundles=BundleConfig(enabled=False),
        rails=RailsConfig(min_replicas=1, cooldown_s=0, evict_kinds=("straggler",)),
        quarantine=QuarantineConfig(after=after)))
    try:
        view = mon.sweep_once()
        hand_in(mon, view, [finding("straggler", 1, job, mon.clock())])
        assert job.kills == [job.replica_ids[1]] and mon.hosts.quarantined() == []
    except BaseException:
        mon.stop()
        raise
    return mon, view


def test_a_finding_on_a_group_already_told_to_go_charges_no_host(tmp_path, job):
    """A group's kill sent, its survivors wait for it until torchft drops it: a hang then
    confirmed on the dying incarnation (a shard learns its leader's kill only after its next
    sweep's detectors ran) is the kill's aftermath, not a second offence of its host: with
    --quarantine-after hang=1 it quarantined the straggler's host. Its replacement's findings
    count."""
    mon, view = straggler_evicted(tmp_path, job, hang=1)
    try:
        hand_in(mon, view, [finding("hang", 1, job, mon.clock())])  # the dying incarnation
        assert mon.hosts.quarantined() == []
        job.replica_ids[1] = f"replica_group_1:{uuid.uuid4()}"  # its replacement, same host
        hand_in(mon, view, [finding("hang", 1, job, mon.clock())])
        assert mon.hosts.quarantined() == ["host-g1"]
    finally:
        mon.stop()


def test_a_network_finding_on_a_group_told_to_go_still_charges_its_host(tmp_path, job):
    """The probes measure a host's links, not the dying processes: a network finding confirmed
    on a group already killed (a probe round asked before its kill) counts against its host."""
    mon, view = straggler_evicted(tmp_path, job, network=1)
    try:
        hand_in(mon, view, [finding("network", 1, job, mon.clock())])
        assert mon.hosts.quarantined() == ["host-g1"]
    finally:
        mon.stop()
