"""A sharded monitor's leader and shard on an in-memory etcd (monitor/shard.py,
monitor/shard_leader.py; docs/scaling.md, "The etcd protocol"): a kill a dead leader left in
flight goes through the rails before it is sent again, a failed kill only once its shard swept
on a read that saw it failed, and ``POST /v1/evict`` on a shard makes an automatic proposal
manual."""

from __future__ import annotations

import base64
import dataclasses
import json
from types import SimpleNamespace

import pytest

import monitor.shard_leader
from monitor.config import RailsConfig
from monitor.lease import KV, LeaderLease, SessionLease
from monitor.shard import Leader, Shards
from tests.test_monitor_shard import _Lighthouse, _Monitor, swept

PREFIX = "/lk"
ROOT = f"{PREFIX}/sim/"
RID = "replica_group_1:5b0c4e2e"


class MemEtcd:
    """The calls monitor.lease.Etcd answers, on a dict: revisions, compares, leases."""

    def __init__(self) -> None:
        self.kvs: dict[str, KV] = {}
        self.rev, self.leases = 1, {}

    def call(self, path: str, body: dict) -> dict:
        if path == "/v3/lease/grant":
            self.rev += 1
            self.leases[self.rev] = True
            return {"ID": str(self.rev), "TTL": body["TTL"]}
        if path == "/v3/lease/keepalive":
            return {"result": {"TTL": "5" if int(body["ID"]) in self.leases else "0"}}
        if path == "/v3/lease/revoke":
            self.leases.pop(int(body["ID"]), None)
            self.kvs = {k: kv for k, kv in self.kvs.items() if kv.lease != int(body["ID"])}
            return {}
        raise AssertionError(path)

    def get(self, key: str) -> KV | None:
        return self.kvs.get(key)

    def range_prefix(self, prefix: str) -> list[KV]:
        return [kv for k, kv in sorted(self.kvs.items()) if k.startswith(prefix)]

    def put(self, key: str, value, lease: int = 0) -> None:
        self.rev += 1
        old = self.kvs.get(key)
        self.kvs[key] = KV(key, json.dumps(value, sort_keys=True).encode(),
                           old.create_revision if old else self.rev, self.rev, lease)

    def _holds(self, c: dict) -> bool:
        kv = self.kvs.get(base64.b64decode(c["key"]).decode())
        field, have = {"CREATE": ("create_revision", kv and kv.create_revision),
                       "MOD": ("mod_revision", kv and kv.mod_revision),
                       "LEASE": ("lease", kv and kv.lease)}[c["target"]]
        return int(have or 0) == int(c[field])

    def put_if(self, compare: list[dict], key: str, value, lease: int = 0):
        ok = all(self._holds(c) for c in compare)
        if ok:
            self.put(key, value, lease)
        return ok, {"header": {"revision": str(self.rev)}, "succeeded": ok}

    def delete_if(self, compare: list[dict], key: str) -> bool:
        ok = all(self._holds(c) for c in compare)
        if ok:
            self.rev += 1
            self.kvs.pop(key, None)
        return ok

    def value(self, key: str):
        kv = self.kvs.get(ROOT + key)
        return kv.json() if kv else None

    def close(self) -> None:
        pass


def _monitor(rails: RailsConfig, shards: int = 1, index: int | None = 0) -> _Monitor:
    mon = _Monitor("http://127.0.0.1:1", PREFIX, index)
    mon.shard_cfg = dataclasses.replace(mon.shard_cfg, shards=shards)
    mon.cfg = dataclasses.replace(mon.cfg, rails=rails, shard=mon.shard_cfg)
    return mon


def _leader(etcd: MemEtcd, mon: _Monitor, lighthouse: _Lighthouse,
            grace: bool = False) -> Leader:
    """``grace``: a kill left in flight is lost only 3 heartbeat timeouts on (the product's),
    else at first sight (the grace is tested once, below)."""
    leader = Leader(mon.shard_cfg, mon, ROOT)
    for conn in (leader.etcd, leader.lighthouse, leader.reader):
        conn.close()
    leader.etcd = etcd
    leader.election = LeaderLease(etcd, ROOT + "leader", {"name": "leader"}, 5)
    leader.lighthouse = leader.reader = lighthouse
    if not grace:
        leader.resend_after_s = 0.0
    return leader


def _tick(leader: Leader) -> None:
    """One tick of Leader.run, on this thread."""
    assert leader.election.campaign()
    leader.lead_once()


def _report(etcd: MemEtcd, shard: int = 0, shards: int = 1, records_rev: bool = True) -> None:
    """Shard ``shard``'s report of a sweep (run ``r1``) that read the records now, as it writes
    it after its proposals (``records_rev=False``: as a shard that does not say)."""
    report = {"shard": shard, "shards": shards, "blind": None, "groups": {"1": RID},
              "run": "r1", "ranks": 2}
    if records_rev:
        report["records_rev"] = max((kv.mod_revision for kv in
                                     etcd.range_prefix(f"{ROOT}evictions/")), default=0)
    etcd.put(f"{ROOT}shards/{shard}", report)


def _in_flight(etcd: MemEtcd, manual: bool = False) -> None:
    """Shard 0's proposal (run ``r1``) and a kill on it that a dead leader left ``sending``."""
    etcd.put(f"{ROOT}proposals/{RID}", {
        "replica_group": 1, "replica_id": RID, "shard": 0, "run": "r1", "kind": "hang",
        "manual": manual, "source": "manual" if manual else "auto"})
    etcd.put(f"{ROOT}evictions/{RID}", {
        "state": "sending", "replica_id": RID, "replica_group": 1, "kind": "hang", "shard": 0,
        "attempt": 1, "leader": "dead-leader", "at": 800.0})


def _holds(mon: _Monitor) -> list[str]:
    return [d["reason"] for d in mon.store.decisions(decision="hold") if d["replica_id"] == RID]


@pytest.mark.parametrize("rails, shards, held", [
    (RailsConfig(dry_run=True, min_replicas=1, cooldown_s=0), 1, "dry_run"),
    (RailsConfig(min_replicas=1, cooldown_s=0), 2, "monitor_blind"),  # shard 1 never reported
    (RailsConfig(min_replicas=3, cooldown_s=0), 1, "min_replicas"),  # 2 groups would remain
])
def test_a_kill_lost_in_flight_is_sent_again_only_through_the_rails(rails, shards, held):
    """A dead leader's ``sending`` whose group still heartbeats after the grace: the new leader
    under --dry-run, blind, or below --min-replicas sends nothing, records the kill ``failed``
    and holds its proposal for that rail."""
    etcd, lighthouse = MemEtcd(), _Lighthouse([RID, "a", "b"])
    mon = _monitor(rails, shards=shards, index=None)
    leader = _leader(etcd, mon, lighthouse)
    _report(etcd, shards=shards)
    _in_flight(etcd)
    try:
        _tick(leader)
        _report(etcd, shards=shards)  # shard 0 swept since: its proposal still stands
        _tick(leader)
        assert lighthouse.kills == []
        assert etcd.value(f"evictions/{RID}")["state"] == "failed"
        assert _holds(mon) == [held]
        lost = [d for d in mon.store.decisions(decision="evict") if d["replica_id"] == RID]
        assert [d["status"] for d in lost] == ["leader_failed"]
        assert "dead-leader" in lost[0]["detail"]
    finally:
        mon.store.close()


def test_a_kill_lost_in_flight_is_sent_again_when_the_rails_pass_after_the_grace(monkeypatch):
    """Not before the grace (3 Lighthouse heartbeat timeouts, as declared); then once its shard
    swept since the kill was declared lost and its proposal stands: attempt 2, recorded
    ``sent``."""
    clock = SimpleNamespace(t=1000.0)
    monkeypatch.setattr(monitor.shard_leader, "time", SimpleNamespace(monotonic=lambda: clock.t))
    etcd, lighthouse = MemEtcd(), _Lighthouse([RID, "a", "b"])
    mon = _monitor(RailsConfig(min_replicas=1, cooldown_s=60), index=None)
    mon.cfg = dataclasses.replace(mon.cfg, lighthouse_heartbeat_timeout_ms=2000)
    leader = _leader(etcd, mon, lighthouse, grace=True)
    _report(etcd)
    _in_flight(etcd)
    try:
        _tick(leader)
        clock.t += 5.9
        _tick(leader)
        assert etcd.value(f"evictions/{RID}")["state"] == "sending" and lighthouse.kills == []
        clock.t += 0.1
        _tick(leader)
        assert lighthouse.kills == []  # shard 0 may withdraw the proposal first
        _report(etcd)
        _tick(leader)
        assert lighthouse.kills == [RID]
        rec = etcd.value(f"evictions/{RID}")
        assert (rec["state"], rec["attempt"]) == ("sent", 2)
    finally:
        mon.store.close()


def test_a_failed_kill_of_a_shard_that_does_not_say_what_it_read_waits_for_two_reports():
    """A report without ``records_rev`` (an older shard) may come from a sweep that read the
    records before the kill failed: the second report since, whose sweep began after the first
    was written, lets the leader send attempt 2."""
    etcd, lighthouse = MemEtcd(), _Lighthouse([RID, "a", "b"])
    mon = _monitor(RailsConfig(min_replicas=1, cooldown_s=0), index=None)
    leader = _leader(etcd, mon, lighthouse)
    _report(etcd, records_rev=False)
    _in_flight(etcd)
    try:
        _tick(leader)
        assert etcd.value(f"evictions/{RID}")["state"] == "failed"
        _report(etcd, records_rev=False)
        _tick(leader)
        _tick(leader)
        assert lighthouse.kills == []
        _report(etcd, records_rev=False)
        _tick(leader)
        assert lighthouse.kills == [RID]
        assert etcd.value(f"evictions/{RID}")["attempt"] == 2
    finally:
        mon.store.close()


def _shard(etcd: MemEtcd, mon: _Monitor) -> SimpleNamespace:
    shard = Shards(mon.shard_cfg, mon)
    shard.etcd.close()
    shard.etcd, shard.session = etcd, SessionLease(etcd, 5)

    def sweep():
        mon.sweeps += 1
        shard.after_sweep(SimpleNamespace(ranks={}, groups={}), swept(), mon.now)
        assert shard.to_json()["error"] is None

    return SimpleNamespace(shard=shard, sweep=sweep)


def test_a_kill_lost_in_flight_whose_finding_resolved_is_withdrawn_not_sent_again():
    """The finding resolved while a dead leader's kill was ``sending`` (the shard could not
    withdraw it then): the new leader records the kill ``failed``, the shard withdraws the
    proposal on its next sweep, and nothing is sent."""
    etcd, lighthouse = MemEtcd(), _Lighthouse([RID, "a", "b"])
    mon = _monitor(RailsConfig(min_replicas=1, cooldown_s=0))
    leader_mon = _monitor(RailsConfig(min_replicas=1, cooldown_s=0), index=None)
    s = _shard(etcd, mon)
    leader = _leader(etcd, leader_mon, lighthouse)
    try:
        mon.find(RID)
        s.sweep()  # its report, then its proposal
        s.sweep()
        assert etcd.value(f"proposals/{RID}")["kind"] == "hang"
        etcd.put(f"{ROOT}evictions/{RID}", {
            "state": "sending", "replica_id": RID, "replica_group": 1, "kind": "hang",
            "shard": 0, "attempt": 1, "leader": "dead-leader", "at": 990.0})
        mon.open.clear()
        s.sweep()
        assert etcd.value(f"proposals/{RID}") is not None  # a kill in flight on it
        _tick(leader)
        s.sweep()
        _tick(leader)
        _tick(leader)
        assert lighthouse.kills == []
        assert etcd.value(f"proposals/{RID}") is None
        assert etcd.value(f"evictions/{RID}")["state"] == "failed"
        assert "withdrawn" in [d["decision"] for d in mon.store.decisions()]
    finally:
        mon.store.close()
        leader_mon.store.close()


def test_a_manual_eviction_makes_the_shards_automatic_proposal_manual():
    """The leader holds the shard's straggler proposal (cooldown); the operator forces it with
    ``POST /v1/evict``: the proposal becomes manual (audit row on the shard), the shard does not
    withdraw it when the finding resolves, and the leader sends it despite the cooldown."""
    etcd, lighthouse = MemEtcd(), _Lighthouse([RID, "a", "b"])
    mon = _monitor(RailsConfig(min_replicas=1, cooldown_s=60))
    leader_mon = _monitor(RailsConfig(min_replicas=1, cooldown_s=60), index=None)
    s = _shard(etcd, mon)
    leader = _leader(etcd, leader_mon, lighthouse)
    etcd.put(f"{ROOT}evictions/replica_group_2:x", {"state": "sent", "replica_id": "x",
                                                     "at": mon.now - 5})
    try:
        mon.find(RID)
        s.sweep()
        s.sweep()
        _tick(leader)
        assert _holds(leader_mon) == ["cooldown"] and lighthouse.kills == []
        out = s.shard.propose_manual(1, RID, "operator: drain")
        assert out["decision"] == "proposed" and out["reason"] == "made_manual", out
        p = etcd.value(f"proposals/{RID}")
        assert (p["manual"], p["source"], p["detail"]) == (True, "manual", "operator: drain")
        row = mon.store.decisions(decision="proposed")[0]
        assert (row["source"], row["replica_id"]) == ("manual", RID)
        assert "operator: drain" in row["detail"]
        mon.open.clear()
        s.sweep()
        assert etcd.value(f"proposals/{RID}")["manual"] is True  # not withdrawn
        _tick(leader)
        assert lighthouse.kills == [RID]
        assert etcd.value(f"evictions/{RID}")["state"] == "sent"
    finally:
        mon.store.close()
        leader_mon.store.close()


@pytest.mark.parametrize("state, reason", [("sending", "kill_in_flight"),
                                           ("sent", "already_evicted")])
def test_a_manual_eviction_of_a_proposal_already_acted_on_says_so(state, reason):
    """A leader's kill is in flight (or sent) on the automatic proposal: the proposal stays as it
    is and the answer (409) and an audit row say why."""
    etcd = MemEtcd()
    mon = _monitor(RailsConfig(min_replicas=1, cooldown_s=60))
    s = _shard(etcd, mon)
    try:
        mon.find(RID)
        s.sweep()
        s.sweep()
        etcd.put(f"{ROOT}evictions/{RID}", {"state": state, "replica_id": RID, "attempt": 1})
        out = s.shard.propose_manual(1, RID, "operator: drain")
        assert (out["decision"], out["reason"]) == ("hold", reason), out
        assert etcd.value(f"proposals/{RID}")["manual"] is False
        row = mon.store.decisions()[0]
        assert (row["decision"], row["reason"], row["source"]) == ("hold", reason, "manual")
    finally:
        mon.store.close()



@pytest.mark.parametrize("in_flight", [True, False])
def test_a_kill_failed_while_its_shard_swept_waits_for_a_sweep_that_read_it_failed(in_flight):
    """The leader records a kill ``failed`` after the shard read the records but before its
    report (a dead leader's kill lost, or its own kill refused): the shard saw it ``sending`` or
    not at all, so could not withdraw the proposal though its finding resolved. That report does
    not let the leader send it again; the next sweep withdraws the proposal, nothing is sent."""
    etcd, lighthouse = MemEtcd(), _Lighthouse([RID, "a", "b"])
    mon = _monitor(RailsConfig(min_replicas=1, cooldown_s=0))
    leader_mon = _monitor(RailsConfig(min_replicas=1, cooldown_s=0), index=None)
    s = _shard(etcd, mon)
    leader = _leader(etcd, leader_mon, lighthouse)
    range_prefix = etcd.range_prefix

    def leader_ticks_after_the_read(prefix):
        read = range_prefix(prefix)
        if prefix == f"{ROOT}evictions/":
            etcd.range_prefix = range_prefix  # once
            _tick(leader)
            assert etcd.value(f"evictions/{RID}")["state"] == "failed"
        return read

    try:
        mon.find(RID)
        s.sweep()
        s.sweep()
        if in_flight:  # a dead leader's, lost
            etcd.put(f"{ROOT}evictions/{RID}", {
                "state": "sending", "replica_id": RID, "replica_group": 1, "kind": "hang",
                "shard": 0, "attempt": 1, "leader": "dead-leader", "at": 990.0})
        lighthouse.down = not in_flight
        mon.open.clear()
        etcd.range_prefix = leader_ticks_after_the_read
        s.sweep()
        assert etcd.range_prefix == range_prefix
        assert etcd.value(f"proposals/{RID}") is not None  # the record changed since read
        lighthouse.down = False
        sent = list(lighthouse.kills)
        _tick(leader)
        assert lighthouse.kills == sent  # its report came from a read before the failure
        s.sweep()
        assert etcd.value(f"proposals/{RID}") is None
        _tick(leader)
        assert lighthouse.kills == sent == ([] if in_flight else [RID])
        assert etcd.value(f"evictions/{RID}")["state"] == "failed"
        assert "withdrawn" in [d["decision"] for d in mon.store.decisions()]
    finally:
        mon.store.close()
        leader_mon.store.close()
