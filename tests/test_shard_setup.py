"""A shard set up so that nothing acts on it says so (monitor/shard.py; docs/scaling.md): its
index held by a monitor of another --shards, or no leader under its --etcd-prefix/--job.
``/v1/cluster``'s ``shard.error`` and ``lightkeeper_monitor_shard_etcd_up{role="shard"} 0``.

Monitors of shards in this process on a real etcd (tests/test_monitor_shard.py), simulated
ranks, the Lighthouse's status faked; swept by hand.
"""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client import generate_latest

from lightkeeper.processes import wait_until
from monitor.api.app import create_app
from monitor.lease import Etcd, LeaderLease
from tests.support.monitor_sim import SimRanks
from tests.test_monitor_shard import running_etcd
from tests.test_shard_decide import _shard
from tests.test_shard_rails import ROOT
from tests.test_shard_standby_actions import GROUPS


@pytest.fixture
def etcd_url(tmp_path):
    with running_etcd(tmp_path) as url:
        yield url


def _etcd_up(mon) -> str:
    return next(line for line in generate_latest(mon.metrics.registry).decode().splitlines()
                if line.startswith('lightkeeper_monitor_shard_etcd_up{job="sim",role="shard"}'))


def test_a_shard_whose_index_a_stray_of_another_shard_count_holds_says_so(
        tmp_path, etcd_url, caplog):
    """A stray --shard 1/3 holds shards/1 while the real 1/2 restarts: 1/2 stands by, and says
    in an error naming both counts that it does (not as a twin of its own --shards, which waits
    for the other's lease in silence); a leader is there, so that is its only error."""
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    etcd = Etcd(etcd_url)
    leader = LeaderLease(etcd, ROOT + "leader", {"name": "leader"}, 30)
    assert leader.campaign()
    for d in ("stray", "real"):
        (tmp_path / d).mkdir()
    stray = _shard(tmp_path / "stray", sim, etcd_url, index=1, shards=3)
    real = _shard(tmp_path / "real", sim, etcd_url, index=1, shards=2)
    try:
        stray.sweep_once()
        assert etcd.get(ROOT + "shards/1").json()["shards"] == 3
        with caplog.at_level(logging.ERROR, logger="monitor.shard"):
            real.sweep_once()
        shard = real.cluster_json()["shard"]
        assert shard["standby"] is True
        assert "shard 1/2 is held by a monitor of --shards 3" in shard["error"], shard["error"]
        assert "shard 1/3" in shard["error"] and "no leader" not in shard["error"]
        assert [r.levelno for r in caplog.records if "--shards 3" in r.getMessage()] == \
            [logging.ERROR]
        assert _etcd_up(real).endswith(" 0.0")
        stray.stop()  # its lease revoked: the real one takes its index, the error clears
        real.sweep_once()
        shard = real.cluster_json()["shard"]
        assert (shard["standby"], shard["error"]) == (False, None)
        assert _etcd_up(real).endswith(" 1.0")
    finally:
        real.stop()
        stray.stop()
        leader.resign()
        etcd.close()
        sim.stop()


def test_a_shard_with_no_leader_under_its_prefix_says_so_until_one_appears(
        tmp_path, etcd_url):
    """No ``leader`` key under the shard's prefix for 3 lease TTLs (a leader started with
    another --etcd-prefix or --job): its error says nothing acts on its proposals; a leader
    appearing there clears it, and the shard's page names it."""
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    etcd = Etcd(etcd_url)
    mon = _shard(tmp_path, sim, etcd_url, lease_ttl_s=2)
    leader = LeaderLease(etcd, ROOT + "leader",
                         {"name": "leader", "monitor": "http://127.0.0.1:9/"}, 30)
    page = create_app(mon).test_client()
    try:
        mon.sweep_once()
        assert mon.cluster_json()["shard"]["error"] is None
        assert "shard 0/1, no leader seen" in page.get("/").get_data(as_text=True)
        started = time.monotonic()

        def said() -> str | None:
            mon.sweep_once()
            return mon.cluster_json()["shard"]["error"]

        wait_until(said, 20, interval=0.2, what="the shard saying it has no leader")
        assert time.monotonic() - started > 3 * 2 - 1
        assert f"no leader under {ROOT}" in said()
        assert _etcd_up(mon).endswith(" 0.0")
        assert leader.campaign()
        assert said() is None and _etcd_up(mon).endswith(" 1.0")
        assert mon.cluster_json()["shard"]["leader"]["name"] == "leader"
        assert 'shard 0/1, leader <a href="http://127.0.0.1:9/">leader</a>' in \
            page.get("/").get_data(as_text=True)
    finally:
        mon.stop()
        leader.resign()
        etcd.close()
        sim.stop()
