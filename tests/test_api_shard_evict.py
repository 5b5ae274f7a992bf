"""``POST /v1/evict`` on a shard that could not write its proposal: 503 with ``Retry-After``
(asking again may pass), not 409, which says a rail held it (docs/monitor.md, API)."""

from __future__ import annotations

import pytest

from monitor.api.app import create_app
from monitor.config import MonitorConfig, ShardConfig
from monitor.shard import Shards, shard_of
from monitor.store import Store
from tests.support.http_stub import HttpStub

TOKEN = "adm"
RID = "replica_group_0:x"


class _ShardMonitor:
    """What ``create_app``'s ``POST /v1/evict`` and a :class:`Shards` use of a sharded monitor:
    a real store and shard, shard 0 of ``shards``; ``evict_manual`` as
    ``Monitor.evict_manual`` on a shard, the group's verified replica id being ``RID``."""

    def __init__(self, etcd_url: str, shards: int = 1) -> None:
        shard_cfg = ShardConfig(shards=shards, index=0, etcd=etcd_url, etcd_prefix="/lktest",
                                lease_ttl_s=5)
        self.cfg = MonitorConfig(job="sim", token=TOKEN, shard=shard_cfg)
        self.store, self.url = Store(":memory:"), "http://monitor-0"
        self.shard = Shards(shard_cfg, self)

    def clock(self) -> float:
        return 1000.0

    def evict_manual(self, replica_group: int, reason: str) -> dict:
        out = self.shard.propose_manual(replica_group, RID, reason)
        out.update(replica_group=replica_group, replica_id=RID)
        return out

    def close(self) -> None:
        self.shard.etcd.close()
        self.store.close()


def _evict(mon: _ShardMonitor, replica_group: int = 0):
    return create_app(mon).test_client().post(
        "/v1/evict", json={"replica_group": replica_group, "reason": "drain"},
        headers={"Authorization": f"Bearer {TOKEN}"})


@pytest.fixture
def churning_etcd():
    """An etcd gateway where the proposal always exists when written and is gone when read."""
    # a txn that did not succeed (proto3 JSON leaves out the false); a range of no keys
    with HttpStub({"POST": (200, {"header": {}})}) as etcd:
        yield etcd.url


def test_a_shard_whose_etcd_is_unreachable_answers_503_with_retry_after():
    mon = _ShardMonitor("http://127.0.0.1:1")  # nothing listens on port 1: refused
    try:
        r = _evict(mon)
        assert r.status_code == 503, r.get_json()
        assert r.headers["Retry-After"] == "1"
        assert r.get_json()["decision"] == "hold"
        assert r.get_json()["reason"] == "etcd_unreachable"
    finally:
        mon.close()


def test_a_shard_whose_proposal_keeps_changing_answers_503_busy(churning_etcd):
    mon = _ShardMonitor(churning_etcd)
    try:
        r = _evict(mon)
        assert r.status_code == 503, r.get_json()
        assert r.headers["Retry-After"] == "1"
        assert r.get_json()["reason"] == "busy"
    finally:
        mon.close()


def test_another_shards_group_is_still_held_with_409(churning_etcd):
    """A rail's hold (here: the group is another shard's) keeps its 409."""
    mon = _ShardMonitor(churning_etcd, shards=2)
    try:
        r = _evict(mon, next(g for g in range(100) if shard_of(g, 2) != 0))
        assert r.status_code == 409 and r.get_json()["reason"] == "other_shard"
        assert "Retry-After" not in r.headers
    finally:
        mon.close()
