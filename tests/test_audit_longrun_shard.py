"""A sharded monitor over a job that runs for weeks (docs/scaling.md, The etcd protocol): what
each eviction leaves in etcd must not be read for ever.

Real parts: a real etcd (Debian's, on 127.0.0.1 with ephemeral ports and a temp data dir,
stopped by PID: ``start_etcd`` of tests/test_monitor_shard.py), a real torchft Lighthouse that
simulated groups join (``SimJob``), and the leader as a ``Monitor`` in this process.
"""

from __future__ import annotations

import time
import uuid

import pytest

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig, RailsConfig, ShardConfig
from monitor.lease import Etcd
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob
from tests.test_monitor_shard import keys, running_etcd


@pytest.fixture
def etcd(tmp_path):
    with running_etcd(tmp_path) as url:
        yield url


def test_the_leader_deletes_the_keys_of_kills_long_done(tmp_path, etcd):
    """Every eviction leaves a proposal and a record, and every shard's sweep and every leader
    tick read all of them (5,000 evictions: ~0.3 s a sweep, measured on this VM). A kill sent
    over an hour ago of a group the Lighthouse no longer hears now goes with its proposal; a
    recent one, and an old one whose group still heartbeats, stay; nothing is sent again."""
    job = SimJob(2)
    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    root = f"{prefix}/sim/"
    now = time.time()
    old = [f"replica_group_{i % 2}:gone-{i}" for i in range(20)]
    kept = {f"replica_group_0:{uuid.uuid4()}": now - 60,  # sent a minute ago
            job.replica_ids[1]: now - 7200}  # long ago, but the group still heartbeats
    e = Etcd(etcd)
    for rid, at in [*((r, now - 7200) for r in old), *kept.items()]:
        g = int(rid.split(":")[0].rsplit("_", 1)[1])
        e.put(root + f"proposals/{rid}", {"replica_group": g, "replica_id": rid,
                                          "kind": "hang", "shard": 0, "run": "r"})
        e.put(root + f"evictions/{rid}", {"state": "sent", "replica_id": rid, "shard": 0,
                                          "replica_group": g, "kind": "hang", "attempt": 1,
                                          "leader": "earlier", "at": at, "done_at": at})
    e.close()
    mon = Monitor(MonitorConfig(
        port=0, interval_s=0.2, state_path=str(tmp_path / "m.sqlite"),
        sd_out=str(tmp_path / "m.json"), job="sim", lighthouse=job.url,
        rails=RailsConfig(min_replicas=1, cooldown_s=0),
        shard=ShardConfig(shards=1, index=None, etcd=etcd, lead=True, etcd_prefix=prefix,
                          lease_ttl_s=2))).start()
    try:
        wait_until(lambda: mon.cluster_json()["shard"]["leading"], 15, what="leadership")
        left = {f"{kind}/{rid}" for kind in ("proposals", "evictions") for rid in kept}
        wait_until(lambda: set(keys(etcd, root)) - {"leader"} == left, 15,
                   what="the old kills' keys deleted")
        assert job.kills == []
    finally:
        mon.stop()
        job.stop()
