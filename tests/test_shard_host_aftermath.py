"""What a shard's host ledger charges around its leader's kill (monitor/act/host_side.py,
HostSide.judge_hosts, run for real over a real HostLedger and the shard's real audit log, its
Enforcer's other parts stand-ins; the shard and its leader on a real etcd, the leader's
Lighthouse faked: tests/test_monitor_shard.py's ``sharded``). A sweep's findings are judged
against the kills known before its detectors ran, and the leader's kills its shard copied from
records read before it proposed: neither the finding that got a group killed is lost, nor is
the dying group's aftermath charged to its host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from monitor.act.host_side import HostSide
from monitor.act.hosts import HostLedger
from monitor.config import QuarantineConfig
from monitor.detect.findings import Finding
from tests.test_monitor_shard import etcd, sharded  # noqa: F401  (fixtures)


def _before(h) -> tuple[set[str], set[str]]:
    """The kills known as a sweep's detectors run (Monitor._sweep)."""
    return h.mon.store.told_to_go_replica_ids(), h.mon.store.evicted_replica_ids()


def _judge(h, new: list[Finding], before: tuple[set[str], set[str]]) -> list[tuple]:
    """judge_hosts of the shard's monitor on ``new`` (--quarantine-after hang=1,dead_rank=1):
    the offences charged (host, kind, counts)."""
    ledger = HostLedger(h.mon.store, QuarantineConfig(after={"hang": 1, "dead_rank": 1}), [], "sim",
                        lambda: h.mon.now)
    me = SimpleNamespace(
        store=h.mon.store, hosts=ledger, _finding_ids={}, _hosts_failed=False,
        dead=SimpleNamespace(agreed=lambda *a: []),
        detectors=SimpleNamespace(open_findings=lambda: [], network_hosts_added=lambda: []),
        blind_to_kills=lambda *a, **k: None,
        cfg=SimpleNamespace(rails=SimpleNamespace(min_replicas=0)),
        metrics=SimpleNamespace(set_hosts=lambda *a: None),
        hosts_trouble=SimpleNamespace(update=lambda *a, **k: None),
        _host_ledger_failed=lambda e, now: (_ for _ in ()).throw(e))
    view = SimpleNamespace(groups={1: SimpleNamespace(hosts={"host-g1"})}, ranks={},
                           in_quorum=lambda: [])
    HostSide.judge_hosts(me, view, new, h.mon.now, None, before)
    return [(x["host"], o["kind"], o["counts"]) for x in ledger.to_json(h.mon.now)
            for o in x["offences"]]


def _hang(h, kind: str = "hang") -> Finding:
    return Finding(kind, 1, h.rid, [1], {"culprit_ranks": [1], "culprits": [
        {"rank": 1, "host": "host-g1"}]}, h.mon.now - 2, h.mon.now)


@pytest.mark.parametrize("kind", ["hang", "dead_rank"])
def test_a_lead_shards_finding_is_charged_though_its_leader_kills_before_the_ledger(sharded, kind):  # noqa: F811
    """--shard 0/1 --lead: the leader thread writes its kill into the shard's own audit log the
    moment it kills; a tick between the sweep's proposal and its host ledger made the finding
    that got the group killed look like the kill's aftermath: never charged."""
    h = sharded
    h.leader_for(h.mon)
    h.sweep()
    h.mon.now += 0.5
    before = _before(h)  # as this sweep's detectors had it
    f = _hang(h, kind)
    h.mon.find(h.rid)
    h.sweep()  # proposed
    h.tick()  # the leader's tick lands before this sweep's host ledger
    assert h.lighthouse.kills == [h.rid] and h.rid in h.mon.store.told_to_go_replica_ids()
    assert _judge(h, [f], before) == [("host-g1", kind, True)]


def test_a_shard_charges_no_hang_on_the_group_its_leader_killed_since_its_last_sweep(sharded):  # noqa: F811
    """The leader kills between two shard sweeps; the next sweep's detectors, not yet knowing,
    confirm a hang on the dying group (its survivors wait for it); its after_sweep copies the
    kill before the host ledger: no offence (with hang=1 it quarantined the host)."""
    h = sharded
    h.sweep()
    h.mon.now += 0.5
    h.mon.find(h.rid)  # what got it killed (charged in its own sweep)
    h.sweep()  # proposed
    h.tick()  # the leader, its own monitor, kills
    h.mon.now += 0.5
    before = _before(h)
    assert h.rid not in before[0] | before[1]  # not yet known to the shard
    h.sweep()  # copies the kill
    assert _judge(h, [_hang(h)], before) == []
    assert _judge(h, [_hang(h, "dead_rank")], before) == []
