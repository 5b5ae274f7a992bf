"""The overview lists the targets in no replica group (one that never answered: a mistyped
address) with why, next to the groups; "no ranks known yet" only when no target is known."""

from __future__ import annotations

from monitor.api import app as app_module
from monitor.api.app import create_app
from monitor.config import MonitorConfig, ShardConfig
from monitor.lease import SessionLease
from monitor.service import Monitor
from monitor.shard import shard_of
from tests.support.monitor_sim import SimRanks
from tests.test_shard_rails import PREFIX, MemEtcd


def _overview(tmp_path, targets: list[str]) -> str:
    mon = Monitor(MonitorConfig(port=0, targets=targets, state_path=str(tmp_path / "m.db")))
    try:
        mon.sweep_once()
        return create_app(mon).test_client().get("/").get_data(as_text=True)
    finally:
        mon.stop()


def test_a_target_that_never_answered_is_listed_with_why(tmp_path):
    page = _overview(tmp_path, ["http://127.0.0.1:1"])  # nothing listens on port 1: refused
    assert "no ranks known yet" not in page
    table = page[page.index('<table id="ungrouped">'):page.index("<h2>Findings")]
    assert "http://127.0.0.1:1" in table
    assert '<td class="unreachable">connection</td>' in table
    assert "Connection" in table  # the error as /v1/cluster's ungrouped say it
    assert "1 targets known, none has said its group" in page


def test_the_overview_lists_a_bounded_number_of_ungrouped_targets(tmp_path, monkeypatch):
    monkeypatch.setattr(app_module, "OVERVIEW_UNGROUPED", 1)
    page = _overview(tmp_path, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    table = page[page.index('<table id="ungrouped">'):page.index("<h2>Findings")]
    assert table.count('class="ungrouped"') == 1
    assert "1 more" in table and 'href="/v1/cluster"' in table


def test_no_target_at_all_says_how_to_give_some(tmp_path):
    page = _overview(tmp_path, [])
    assert "no ranks known yet: pass --targets" in page
    assert '<table id="ungrouped">' not in page


def _shard_overview(tmp_path, shard: ShardConfig, urls: list[str]) -> str:
    # a leader candidate needs a Lighthouse: nothing listens on port 1, refused at once
    mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=str(tmp_path / "m.db"),
                                job="sim", shard=shard, lighthouse="http://127.0.0.1:1"))
    try:
        mon.shard.etcd.close()
        etcd = MemEtcd()
        mon.shard.etcd, mon.shard.session = etcd, SessionLease(etcd, 5)
        mon.sweep_once()
        return create_app(mon).test_client().get("/").get_data(as_text=True)
    finally:
        mon.stop()


def test_a_shard_whose_slice_is_empty_says_so_not_that_no_target_said_its_group(tmp_path):
    """Every target answered, in group 0 (shard 0's of 2): shard 1's view holds none of them,
    and a --lead candidate's none at all."""
    sim = SimRanks.start(2, groups=1)
    try:
        assert shard_of(0, 2) == 0
        page = _shard_overview(tmp_path, ShardConfig(shards=2, index=1, etcd="http://127.0.0.1:1",
                                                     etcd_prefix=PREFIX), sim.urls)
        assert ("no replica group of this shard's slice known yet (shard 1/2): 2 targets known, "
                "none has said a group it owns") in page
        assert "none has said its group" not in page
        lead = _shard_overview(tmp_path / "lead", ShardConfig(
            shards=2, index=None, etcd="http://127.0.0.1:1", etcd_prefix=PREFIX, lead=True),
            sim.urls)
        assert "a leader candidate polls no slice: 2 targets known, the shards poll them" in lead
        assert "none has said its group" not in lead
    finally:
        sim.stop()
