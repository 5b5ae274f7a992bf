"""What reading the overview costs the sweeps: its groups x ranks table (what grows with the
job) is rendered once per sweep, however many tabs reload it (benchmarks/bench_monitor_readers.py
measures the cost at 10,000 ranks)."""

from __future__ import annotations

import pytest
from flask import template_rendered

from monitor.api import app as app_module
from monitor.api.app import create_app
from monitor.config import MonitorConfig
from monitor.service import Monitor
from tests.support.clock import ManualClock
from tests.support.monitor_sim import SimRanks


def test_overview_groups_render_once_per_sweep(tmp_path):
    sim = SimRanks.start(4, groups=2)
    clock = ManualClock(1000.0)
    mon = Monitor(MonitorConfig(port=0, targets=[r.url for r in sim.ranks],
                                state_path=str(tmp_path / "m.db")), clock=clock)
    app = create_app(mon)
    rendered: list[str] = []

    def count(sender, template, context, **kw):
        rendered.append(template.name)

    template_rendered.connect(count, app)
    try:
        # the page's view is taken before the first sweep, the groups after it: none shown
        assert app_module.overview_groups(mon, None)["groups"] == []
        mon.sweep_once()
        assert app_module.overview_groups(mon, None) == {
            "groups": [], "hidden_ranks": 0, "total_ranks": 0,
            "limit": app_module.OVERVIEW_RANKS, "hidden_groups": 0}
        client = app.test_client()
        pages = []
        for _ in range(3):  # three tabs, the monitor's clock moving between their reloads
            pages.append(client.get("/").get_data(as_text=True))
            clock.advance(2.0)
        assert rendered.count("overview.html") == 3
        assert rendered.count("groups.html") == 1
        table = pages[0][pages[0].index('<table id="groups">'):pages[0].index("<h2>Findings")]
        assert 'data-replica-group="1"' in table and table.count('class="rank"') == 4
        assert all(table in p for p in pages)  # the same sweep's table, its times included
        # /v1/cluster likewise: encoded once per sweep (0.2 s and 6.5 MB at 10,000 ranks), its
        # times in phase as of its first request, the same bytes to every poller
        first = client.get("/v1/cluster")
        clock.advance(2.0)
        again = client.get("/v1/cluster")
        assert again.get_data() == first.get_data()
        assert again.headers["ETag"] == first.headers["ETag"]
        assert first.get_json()["sweeps"] == 1
        assert sum(len(g["ranks"]) for g in first.get_json()["groups"]) == 4
        unchanged = client.get("/v1/cluster", headers={"If-None-Match": first.headers["ETag"]})
        assert unchanged.status_code == 304 and unchanged.get_data() == b""

        mon.sweep_once()
        page = client.get("/").get_data(as_text=True)
        assert rendered.count("groups.html") == 2  # a new sweep, a new table
        assert f"sweeps {mon.sweeps}" in page and 'class="rank"' in page
        later = client.get("/v1/cluster", headers={"If-None-Match": first.headers["ETag"]})
        assert later.status_code == 200 and later.get_json()["sweeps"] == 2
        before = first.get_json()["groups"][0]["ranks"][0]["phase_for_s"]
        assert later.get_json()["groups"][0]["ranks"][0]["phase_for_s"] - before \
            == pytest.approx(2.0)
    finally:
        template_rendered.disconnect(count, app)
        mon.stop()
        sim.stop()


def test_overview_past_its_bound_lists_the_groups_to_look_at_first(tmp_path, monkeypatch):
    """Past OVERVIEW_RANKS rank rows (1,000; 2 here) the overview lists the groups not all up
    first and counts the rest; /v1/cluster still lists every rank."""
    monkeypatch.setattr(app_module, "OVERVIEW_RANKS", 2)
    sim = SimRanks.start(4, groups=2)
    mon = Monitor(MonitorConfig(port=0, targets=sim.urls, state_path=str(tmp_path / "m.db")))
    try:
        mon.sweep_once()
        sim.group(1)[0].set_mode("down")
        mon.sweep_once()
        client = create_app(mon).test_client()
        page = client.get("/").get_data(as_text=True)
        table = page[page.index('<table id="groups">'):page.index("<h2>Findings")]
        assert 'data-replica-group="1"' in table and 'data-replica-group="0"' not in table
        assert table.count('class="rank"') == 2
        assert "2 of 4 ranks not shown (1 whole groups)" in table
        assert "2 replica groups" in page  # the summary counts every group
        cluster = client.get("/v1/cluster").get_json()
        assert sum(len(g["ranks"]) for g in cluster["groups"]) == 4
    finally:
        mon.stop()
        sim.stop()


def test_a_long_decision_detail_is_whole_on_the_overview(tmp_path):
    """The decisions table cut ``detail`` at 200 characters, where a kill's outcome, the ranks
    told to exit and the confirmation come last: past that length it is folded, not cut."""
    from monitor.store import Store

    tail = "; left the quorum (the Lighthouse's quorum 7: 2 participants without it)"
    long = "straggler confirmed in replica group 1: " + "x" * 300 + tail
    store = Store(str(tmp_path / "m.db"))
    store.add_decision(replica_group=1, replica_id="g1", decision="evict", reason="straggler",
                       detail=long, status="confirmed")
    store.add_decision(replica_group=2, replica_id="g2", decision="hold", reason="cooldown",
                       detail="short <b>one</b>")
    store.close()
    mon = Monitor(MonitorConfig(port=0, targets=[], state_path=str(tmp_path / "m.db")))
    try:
        page = create_app(mon).test_client().get("/").get_data(as_text=True)
        table = page[page.index('<table id="decisions">'):page.index("<h2>Incident bundles")]
        assert tail.replace("'", "&#39;") in table and '<details class="detail">' in table
        assert "short &lt;b&gt;one&lt;/b&gt;" in table and table.count("<details") == 1
    finally:
        mon.stop()
